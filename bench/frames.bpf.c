// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * The frame-sourced benchmark's programs (make bench only, never embedded; scripts/bench_frames.py).
 *
 * frames_gen   the traffic generator: run by BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES
 *              on the client's veth (as xdp-tools' xdp-trafficgen does), it writes the frame of
 *              frames_template (64 bytes) over the page, with a source port of its own (20000 + a
 *              counter, 4096 ports; the UDP checksum is 0, none), and transmits it (XDP_TX): the
 *              frame reaches the load balancer's veth as an XDP frame, as from a NIC's receive
 *              ring, with no socket buffer made on the way. The whole frame is written each time:
 *              the pages are recycled as the load balancer left them (its rewrite included),
 *              and the kernel resets only their pointers. frames_pace sets a fixed rate.
 * frames_sink  the backends: counts (sink_count) and drops the IPv4 UDP that arrives (XDP_DROP),
 *              cheaper than any socket; the rest (ARP) passes.
 * floor_xdp    the bare XDP floor: the Ethernet addresses set for backend 1 and XDP_REDIRECT to
 *              its veth, nothing else (no lookup, no rewrite of IP or UDP).
 * floor_tc     the same at tc ingress (bpf_redirect of the socket buffer).
 * floor_xdp3, floor_tc3  the same spread over the 3 backends in turn (a per-CPU rotation), as
 *              the load balancer spreads them: each destination veth's receive is woken as
 *              often as with the load balancer (on veth that wake-up is a cost of its own).
 * floor_copies the replication floor (scripts/bench_replication.py): at tc ingress, a copy of each
 *              IPv4 datagram to backends 2 and 3 (their Ethernet addresses set, then
 *              bpf_clone_redirect, as udp-fanout's pools make theirs) and the datagram itself to
 *              backend 1 (bpf_redirect): the kernel's part of three copies, with no decision,
 *              lookup or rewrite of IP or UDP.
 * The floors read their targets from floor_out: { ifindex, destination MAC, source MAC }, entry
 * 0 for floor_xdp and floor_tc, entries 1 to 3 (backends 1 to 3) for the spread ones and
 * floor_copies.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

struct floor_target {
	__u32 ifindex;
	unsigned char destination[ETH_ALEN];
	unsigned char source[ETH_ALEN];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 4);
	__type(key, __u32);
	__type(value, struct floor_target);
} floor_out SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} floor_turn SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} frames_count SEC(".maps");

#define FRAME_SIZE 64

struct frame_template {
	unsigned char bytes[FRAME_SIZE];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct frame_template);
} frames_template SEC(".maps");

/* A fixed rate: one frame per interval_ns is transmitted, the others dropped at once (the page
 * goes back to the generator's pool), so the rate is smooth where the system calls are not. A
 * burst of at most FRAMES_BURST frames (the veth ring) after a pause. interval_ns 0: every frame goes. */
struct frames_pace {
	__u64 interval_ns;
	__u64 next_ns;
};

#define FRAMES_BURST 256

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct frames_pace);
} frames_pace SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} sink_count SEC(".maps");

SEC("xdp")
int frames_gen(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	if (data + FRAME_SIZE > data_end)
		return XDP_ABORTED;
	__u32 key = 0;
	__u64 *count = bpf_map_lookup_elem(&frames_count, &key);
	struct frame_template *template = bpf_map_lookup_elem(&frames_template, &key);
	struct frames_pace *pace = bpf_map_lookup_elem(&frames_pace, &key);
	if (!count || !template || !pace)
		return XDP_ABORTED;
	if (pace->interval_ns) {
		/* Run on one CPU only (the generator's): no other writer. */
		__u64 now = bpf_ktime_get_ns();
		__u64 earliest = now - FRAMES_BURST * pace->interval_ns;
		if (pace->next_ns < earliest)
			pace->next_ns = earliest;
		if (now < pace->next_ns)
			return XDP_DROP;
		pace->next_ns += pace->interval_ns;
	}
	__builtin_memcpy(data, template->bytes, FRAME_SIZE);
	struct udphdr *udp = data + sizeof(struct ethhdr) + sizeof(struct iphdr);
	udp->source = bpf_htons(20000 + (*count & 4095));
	*count += 1;
	return XDP_TX;
}

SEC("xdp")
int frames_sink(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	/* ARP and the rest pass: the load balancer's neighbour entries stay valid. */
	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->protocol != IPPROTO_UDP)
		return XDP_PASS;
	__u32 key = 0;
	__u64 *count = bpf_map_lookup_elem(&sink_count, &key);
	if (count)
		*count += 1;
	return XDP_DROP;
}

/* Sets the Ethernet addresses of target `key` of floor_out; 0 to pass the packet on. */
static __always_inline struct floor_target *floor_set(void *data, void *data_end, __u32 key)
{
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return 0;
	struct floor_target *target = bpf_map_lookup_elem(&floor_out, &key);
	if (!target)
		return 0;
	__builtin_memcpy(eth->h_dest, target->destination, ETH_ALEN);
	__builtin_memcpy(eth->h_source, target->source, ETH_ALEN);
	return target;
}

/* The next of the 3 spread targets (1 to 3) on this CPU. */
static __always_inline __u32 floor_next(void)
{
	__u32 key = 0;
	__u32 *turn = bpf_map_lookup_elem(&floor_turn, &key);
	if (!turn)
		return 1;
	__u32 next = *turn + 1 >= 3 ? 0 : *turn + 1;
	*turn = next;
	return next + 1;
}

SEC("xdp")
int floor_xdp(struct xdp_md *ctx)
{
	struct floor_target *target = floor_set((void *)(long)ctx->data, (void *)(long)ctx->data_end, 0);
	return target ? bpf_redirect(target->ifindex, 0) : XDP_PASS;
}

SEC("tc")
int floor_tc(struct __sk_buff *skb)
{
	struct floor_target *target = floor_set((void *)(long)skb->data, (void *)(long)skb->data_end, 0);
	return target ? bpf_redirect(target->ifindex, 0) : TC_ACT_OK;
}

SEC("xdp")
int floor_xdp3(struct xdp_md *ctx)
{
	struct floor_target *target = floor_set((void *)(long)ctx->data, (void *)(long)ctx->data_end, floor_next());
	return target ? bpf_redirect(target->ifindex, 0) : XDP_PASS;
}

SEC("tc")
int floor_tc3(struct __sk_buff *skb)
{
	struct floor_target *target = floor_set((void *)(long)skb->data, (void *)(long)skb->data_end, floor_next());
	return target ? bpf_redirect(target->ifindex, 0) : TC_ACT_OK;
}

SEC("tc")
int floor_copies(struct __sk_buff *skb)
{
	for (__u32 key = 2; key <= 3; key++) {
		struct floor_target *target = floor_set((void *)(long)skb->data, (void *)(long)skb->data_end, key);
		if (!target)
			return TC_ACT_OK;
		if (bpf_clone_redirect(skb, target->ifindex, 0) != 0)
			return TC_ACT_SHOT;
	}
	struct floor_target *target = floor_set((void *)(long)skb->data, (void *)(long)skb->data_end, 1);
	return target ? bpf_redirect(target->ifindex, 0) : TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
