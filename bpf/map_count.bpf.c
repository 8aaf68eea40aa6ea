// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * A BPF iterator over the kernel's maps: for each nat listener's association map (named
 * FANOUT_ASSOCIATION_MAP_PREFIX + listener id), it writes the map's id and the number of
 * entries in it (struct fanout_map_count). The number is the kernel's own per-CPU count
 * (bpf_map_sum_elem_count, Linux 6.6 and later), which LRU evictions keep right too, so
 * udp-fanout counts a full 1,048,576-entry map in microseconds where walking it took most of a
 * second of CPU. Read by userspace through bpf_iter_create on the program's iterator link;
 * where the kernel refuses the program, userspace counts with batched lookups instead.
 *
 * The kernel's own types, declared here as far as read and relocated to the running kernel's
 * layout at load (CO-RE, preserve_access_index).
 */
#include <linux/bpf.h>
#include <linux/types.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"

struct bpf_map {
	__u32 id;
	char name[16];
} __attribute__((preserve_access_index));

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__bpf_map {
	struct bpf_iter_meta *meta;
	struct bpf_map *map;
} __attribute__((preserve_access_index));

extern __s64 bpf_map_sum_elem_count(const struct bpf_map *map) __ksym;

SEC("iter/bpf_map")
int fanout_map_count(struct bpf_iter__bpf_map *ctx)
{
	struct bpf_map *map = ctx->map;
	if (!map)
		return 0;
	const char prefix[] = FANOUT_ASSOCIATION_MAP_PREFIX;
	for (int i = 0; i < (int)sizeof(prefix) - 1; i++)
		if (map->name[i] != prefix[i])
			return 0;
	struct fanout_map_count out = { .id = map->id, .entries = bpf_map_sum_elem_count(map) };
	bpf_seq_write(ctx->meta->seq, &out, sizeof(out));
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
