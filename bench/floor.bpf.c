// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * Benchmark floors for the sk_reuseport program cost (make bench only, never embedded):
 * floor_empty measures what kernel.bpf_stats_enabled itself costs per run on this machine;
 * floor_select reads the IPv4 source and selects a socket (the least any source-steering
 * program must do). rplb_select's cost is compared with both.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct {
	__uint(type, BPF_MAP_TYPE_REUSEPORT_SOCKARRAY);
	__uint(max_entries, 3);
	__type(key, __u32);
	__type(value, __u64);
} floor_members SEC(".maps");

SEC("sk_reuseport")
int floor_empty(struct sk_reuseport_md *md)
{
	return SK_PASS;
}

SEC("sk_reuseport")
int floor_select(struct sk_reuseport_md *md)
{
	__u32 source = 0;
	bpf_skb_load_bytes_relative(md, 12, &source, 4, BPF_HDR_START_NET);
	__u32 slot = source % 3;
	bpf_sk_select_reuseport(md, &floor_members, &slot, 0);
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
