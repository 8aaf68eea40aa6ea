/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The maps of the tc program (bpf/tc_fanout.bpf.c), which the xdp program (bpf/xdp_fanout.bpf.c)
 * is loaded with (the Swift side hands it their descriptors): listeners, backend sets, round-robin positions,
 * remembered fragments, per-listener and per-backend counters, the replication pools' sources, the two-way (nat) maps
 * (associations: an array of per-listener LRU hashes made from the inner map template below;
 * live backends; the listeners' addresses), the load-time options (.rodata), and the small
 * accessors of the counter maps (count_unmatched, backend_stats, count). Names, keys and values
 * are fanout_shared.h's, shared with userspace. This header DEFINES the maps, so only the tc
 * and xdp programs include it (directly or through fanout_choice.h, fanout_nat.h, fanout_redirect.h),
 * never the Swift side (BPFKernelABI.h) nor a *_shared.h. Self-contained: includes linux/bpf.h,
 * bpf_helpers.h and fanout_shared.h itself, so nothing has to come before it.
 */
#ifndef FANOUT_MAPS_H
#define FANOUT_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#ifndef FANOUT_NO_QUIC_CRYPTO
#include "fanout_quic_keys.h" /* the quic_lb keys map, shared with bpf/fanout_quic_keys.bpf.c */
#endif

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, struct fanout_listener_key);
	__type(value, struct fanout_listener);
} FANOUT_MAP_LISTENERS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS * 2);
	__type(key, __u32);
	__type(value, struct fanout_set);
} FANOUT_MAP_SETS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, __u32);
} FANOUT_MAP_RR SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, FANOUT_FRAGMENT_ENTRIES);
	__type(key, struct fanout_fragment_key);
	__type(value, struct fanout_fragment);
} FANOUT_MAP_FRAGMENTS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS + 1);
	__type(key, __u32);
	__type(value, struct fanout_stats);
} FANOUT_MAP_STATS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS * FANOUT_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct fanout_backend_stats);
} FANOUT_MAP_BACKEND_STATS SEC(".maps");

/* Replication pools' `sources`: an entry per prefix of each pool (the value is unused). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, FANOUT_POOL_SOURCE_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct fanout_pool_source_key);
	__type(value, __u8);
} FANOUT_MAP_POOL_SOURCES SEC(".maps");

/* The inner map template: userspace creates one LRU hash per nat listener with
 * max_entries = settings.max_associations (hash inner maps may differ in max_entries). */
struct fanout_association_map {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(struct fanout_association_key));
	__uint(value_size, sizeof(struct fanout_association));
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__array(values, struct fanout_association_map);
} FANOUT_MAP_ASSOCIATIONS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FANOUT_LIVE_ENTRIES);
	__type(key, struct fanout_live_key);
	__type(value, struct fanout_live);
} FANOUT_MAP_LIVE SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_nat);
} FANOUT_MAP_NAT SEC(".maps");

/* quic_lb (fanout_quic.h): configurations by set key, server IDs of the sets' backends, the keys
 * (fanout_quic_keys.h) and the outcomes by listener id. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS * 2);
	__type(key, __u32);
	__type(value, struct fanout_quic_configs);
} FANOUT_MAP_QUIC_CONFIGS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FANOUT_QUIC_ID_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct fanout_quic_id_key);
	__type(value, __u32);
} FANOUT_MAP_QUIC_IDS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_quic_stats);
} FANOUT_MAP_QUIC_STATS SEC(".maps");

const volatile struct fanout_tc_options FANOUT_OPTIONS = {};

/* Counts a packet no listener could be known for. */
static __always_inline void count_unmatched(__u32 verdict)
{
	__u32 key = FANOUT_UNMATCHED_STATS;
	struct fanout_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_STATS, &key);
	if (stats && verdict < FANOUT_VERDICT_COUNT)
		stats->verdicts[verdict]++;
}

/* The per-CPU counters of one backend slot of a listener, or NULL. */
static __always_inline struct fanout_backend_stats *backend_stats(__u32 id, __u32 slot)
{
	if (slot >= FANOUT_MAX_BACKENDS || id >= FANOUT_MAX_LISTENERS)
		return NULL;
	__u32 key = id * FANOUT_MAX_BACKENDS + slot;
	return bpf_map_lookup_elem(&FANOUT_MAP_BACKEND_STATS, &key);
}

/* Counts a listener's verdict, and its reply-direction share. */
static __always_inline void count(struct fanout_stats *stats, int reply, __u32 verdict)
{
	if (verdict >= FANOUT_VERDICT_COUNT)
		return;
	stats->verdicts[verdict]++;
	if (reply)
		stats->reply_verdicts[verdict]++;
}

#endif /* FANOUT_MAPS_H */
