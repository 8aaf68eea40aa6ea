/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * Capture of what a listener drops (`udp-fanout capture`): while a capture runs for a listener,
 * its userspace entry in FANOUT_MAP_CAPTURE_CONFIGS says which reasons and how many packets a
 * second; each dropped packet it takes is copied (from its IP header, at most `snaplen` bytes)
 * into a ring buffer the daemon reads and serves as pcapng. Without a capture the cost of a
 * drop is one array lookup (inline, no call); the forwarding path is not touched. The daemon's reader is
 * Sources/FanoutCore/Capture/KernelCaptureTap.swift.
 */
#ifndef FANOUT_CAPTURE_H
#define FANOUT_CAPTURE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_rate.h"

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, FANOUT_CAPTURE_RING_BYTES);
} FANOUT_MAP_CAPTURE SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_capture_config);
} FANOUT_MAP_CAPTURE_CONFIGS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_capture_stats);
} FANOUT_MAP_CAPTURE_STATS SEC(".maps");

/* Where an event is assembled (per CPU, off the stack) before bpf_ringbuf_output copies its used
 * length into the ring. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fanout_capture_event);
} fanout_capbuf SEC(".maps");

static __always_inline long hook_load_bytes(FANOUT_CTX *ctx, __u32 offset, void *to, __u32 length);
/* The packet's length now (after whatever the decision did to it: a VLAN tag popped, say). */
static __always_inline __u32 hook_current_length(FANOUT_CTX *ctx);

/* `why` of fanout_capture: the reason (a verdict or FANOUT_CAPTURE_*), whether the packet is a
 * reply, and whether it was rewritten for a pool's copy (a BPF function takes five arguments at
 * most). */
#define FANOUT_CAPTURE_WHY(reason, reply) ((__u32)(reason) | ((reply) ? 0x100u : 0u))
#define FANOUT_CAPTURE_WHY_REWRITTEN 0x200u

/* The sampling's charge: as rate_charge, but refused when other CPUs win every try (a sample
 * may be missed, never taken beyond the rate). */
static __always_inline int capture_charge(__u64 *tat, __u64 cost, __u64 tolerance, __u64 now)
{
#pragma clang loop unroll(full)
	for (int attempt = 0; attempt < 4; attempt++) {
		__u64 old = *(volatile __u64 *)tat;
		__u64 next = (old > now ? old : now) + cost;
		if (next - now > tolerance)
			return 0;
		if (__sync_val_compare_and_swap(tat, old, next) == old)
			return 1;
	}
	return 0;
}

/* Copies the packet into the ring for listener `id`'s capture (fanout_capture checked that it
 * wants it): 1 when it went in. Verified once (a global function). */
__noinline int fanout_capture_drop(FANOUT_CTX *ctx, struct packet *p, __u32 id, __u32 why)
{
	__u32 reason = why & 0xff;
	if (!ctx || !p || id >= FANOUT_MAX_LISTENERS || reason >= 64)
		return 0;
	struct fanout_capture_config *config = bpf_map_lookup_elem(&FANOUT_MAP_CAPTURE_CONFIGS, &id);
	if (!config || !config->snaplen)
		return 0;
	struct fanout_capture_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_CAPTURE_STATS, &id);
	if (!stats)
		return 0;
	/* The coarse clock (the last tick's time: no clock read) is enough for a sampling that
	 * allows a tenth of a second's burst, and a drop that is sampled out costs little more
	 * than the check. */
	if (!capture_charge(&config->tat, config->interval, config->tolerance, bpf_ktime_get_coarse_ns())) {
		stats->sampled_out++;
		return 0;
	}
	__u32 zero = 0;
	struct fanout_capture_event *event = bpf_map_lookup_elem(&fanout_capbuf, &zero);
	if (!event) {
		stats->unreadable++;
		return 0;
	}
	/* The IP packet: from its header to what is there now, at most its own length (not the
	 * padding of a short frame). */
	__u32 l3 = p->l3;
	__u32 length = hook_current_length(ctx);
	__u32 wire = length > l3 ? length - l3 : 0;
	if (p->tot_len && p->tot_len < wire)
		wire = p->tot_len;
	__u32 take = wire < config->snaplen ? wire : config->snaplen;
	if (take > FANOUT_CAPTURE_DATA_MAX)
		take = FANOUT_CAPTURE_DATA_MAX;
	if (take < 1 || hook_load_bytes(ctx, l3, event->data, take) < 0) {
		stats->unreadable++;
		return 0;
	}
	event->time = bpf_ktime_get_ns();
	event->listener_id = id;
	event->wire_length = wire;
	event->length = take;
	event->reason = reason;
	event->flags = (why & 0x100 ? FANOUT_CAPTURE_FLAG_REPLY : 0) | (why & FANOUT_CAPTURE_WHY_REWRITTEN ? FANOUT_CAPTURE_FLAG_REWRITTEN : 0);
	event->family = p->family;
	__u64 size = __builtin_offsetof(struct fanout_capture_event, data) + take;
	if (bpf_ringbuf_output(&FANOUT_MAP_CAPTURE, event, size, 0) < 0) {
		stats->ring_full++;
		return 0;
	}
	stats->captured++;
	return 1;
}

/* Whether a capture of listener `id` runs and wants this reason (`why`: FANOUT_CAPTURE_WHY):
 * without a capture, one array lookup (inline, no call). */
static __always_inline int fanout_capture_wanted(__u32 id, __u32 why)
{
	if (id >= FANOUT_MAX_LISTENERS)
		return 0;
	struct fanout_capture_config *config = bpf_map_lookup_elem(&FANOUT_MAP_CAPTURE_CONFIGS, &id);
	if (!config || !config->snaplen)
		return 0;
	__u32 reason = why & 0xff;
	__u64 reasons = why & 0x100 ? config->reply_reasons : config->forward_reasons;
	return reason < 64 && (reasons & (1ULL << reason)) != 0;
}

/* Offers the packet listener `id` drops to its capture, if one wants it. */
static __always_inline void fanout_capture(FANOUT_CTX *ctx, struct packet *p, __u32 id, __u32 why)
{
	if (fanout_capture_wanted(id, why))
		fanout_capture_drop(ctx, p, id, why);
}

#endif /* FANOUT_CAPTURE_H */
