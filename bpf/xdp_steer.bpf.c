// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * XDP program of udp-fanout's af_xdp mode: each whole UDP datagram to a listener's address and
 * port goes to the AF_XDP socket of the receive queue it arrived on; userspace forwards it.
 *
 * Parse Ethernet (up to two 802.1Q/802.1ad tags), IPv4 (with options) or IPv6 (with extension
 * headers), UDP (bpf/include/parse.h). Match the arrival interface and destination against the
 * listeners map (exact address first, then the family's wildcard), as the tc program does.
 * Redirect with bpf_redirect_map on the XSKMAP, keyed by ctx->rx_queue_index.
 *
 * A redirected frame carries what the parse found in its metadata area (struct fanout_xdp_meta),
 * so userspace does not parse it again; where the driver has no metadata area it goes without.
 *
 * Nothing is rewritten and nothing is dropped: what the socket cannot take (fragments, frames
 * longer than a UMEM frame, a queue without a socket) and everything that is not ours goes on
 * to the kernel's stack with XDP_PASS. Every frame gets one counted verdict
 * (enum fanout_xdp_verdict).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "afxdp_shared.h"
#include "parse.h"

/* VLAN tags accepted in the frame: a QinQ frame's two. The socket receives the frame as it
 * arrived, tags included. */
#define FANOUT_XDP_VLAN_TAGS 2

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, struct fanout_xdp_listener_key);
	__type(value, struct fanout_xdp_listener);
} FANOUT_MAP_XDP_LISTENERS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, FANOUT_XDP_MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} FANOUT_MAP_XDP_SOCKETS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS + 1);
	__type(key, __u32);
	__type(value, struct fanout_xdp_stats);
} FANOUT_MAP_XDP_STATS SEC(".maps");

const volatile struct fanout_xdp_options FANOUT_XDP_OPTIONS = {};

/* Counts one frame with its verdict in entry `key` (a listener id or the unmatched entry). */
static __always_inline int count(__u32 key, __u32 length, __u32 verdict)
{
	struct fanout_xdp_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_XDP_STATS, &key);
	if (stats && verdict < FANOUT_XDP_VERDICT_COUNT) {
		stats->received++;
		stats->bytes += length;
		stats->verdicts[verdict]++;
	}
	return XDP_PASS;
}

static __always_inline struct fanout_xdp_listener *find_listener(__u32 ifindex, struct packet *p)
{
	struct fanout_xdp_listener_key key = {};
	key.ifindex = ifindex;
	key.family = p->family;
	key.port = p->dport;
	__builtin_memcpy(key.addr, p->daddr, sizeof(key.addr));
	struct fanout_xdp_listener *listener = bpf_map_lookup_elem(&FANOUT_MAP_XDP_LISTENERS, &key);
	if (listener)
		return listener;
	__builtin_memset(key.addr, 0, sizeof(key.addr));
	return bpf_map_lookup_elem(&FANOUT_MAP_XDP_LISTENERS, &key);
}

/* Hands the parse to userspace in the metadata area (struct fanout_xdp_meta). The frame's data
 * stays as it arrived; a driver without a metadata area refuses the adjustment, and the frame
 * goes without (userspace then parses it). */
static __always_inline void write_meta(struct xdp_md *ctx, struct packet *p)
{
	if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(struct fanout_xdp_meta)))
		return;
	void *data = (void *)(long)ctx->data;
	struct fanout_xdp_meta *meta = (void *)(long)ctx->data_meta;
	if ((void *)(meta + 1) > data)
		return;
	meta->l3 = p->l3;
	meta->l4 = p->l4;
	meta->ip_end = p->l3 + p->tot_len;
	meta->family = p->family;
	meta->hop_limit = p->hop_limit;
	meta->magic = FANOUT_XDP_META_MAGIC;
}

SEC("xdp")
int FANOUT_PROG_XDP(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u32 length = end - data;
	struct packet p = {};
	enum parsed parsed = parse_frame(data, end, length, FANOUT_XDP_VLAN_TAGS, &p);
	if (parsed == PARSED_OTHER)
		return count(FANOUT_XDP_UNMATCHED_STATS, length, FANOUT_XDP_VERDICT_NOT_OURS);
	if (parsed == PARSED_MALFORMED)
		return count(FANOUT_XDP_UNMATCHED_STATS, length, FANOUT_XDP_VERDICT_MALFORMED);
	/* A later fragment carries no port: no listener can be known. The kernel reassembles it
	 * with its first fragment, which passed too. */
	if (!p.has_udp)
		return count(FANOUT_XDP_UNMATCHED_STATS, length, FANOUT_XDP_VERDICT_FRAGMENT);

	struct fanout_xdp_listener *listener = find_listener(ctx->ingress_ifindex, &p);
	if (!listener)
		return count(FANOUT_XDP_UNMATCHED_STATS, length, FANOUT_XDP_VERDICT_NOT_OURS);
	__u32 id = listener->id;
	/* Userspace bounds ids; an id out of range is counted rather than lost. */
	if (id >= FANOUT_MAX_LISTENERS)
		return count(FANOUT_XDP_UNMATCHED_STATS, length, FANOUT_XDP_VERDICT_NOT_OURS);
	if (p.fragment)
		return count(id, length, FANOUT_XDP_VERDICT_FRAGMENT);
	if (length > FANOUT_XDP_OPTIONS.max_frame_len)
		return count(id, length, FANOUT_XDP_VERDICT_TOO_LARGE);

	__u32 queue = ctx->rx_queue_index;
	/* bpf_redirect_map would fall back to XDP_PASS too, but only the lookup tells the two
	 * outcomes apart for the counters. */
	if (!bpf_map_lookup_elem(&FANOUT_MAP_XDP_SOCKETS, &queue))
		return count(id, length, FANOUT_XDP_VERDICT_NO_SOCKET);
	write_meta(ctx, &p);
	long action = bpf_redirect_map(&FANOUT_MAP_XDP_SOCKETS, queue, XDP_PASS);
	if (action != XDP_REDIRECT)
		return count(id, length, FANOUT_XDP_VERDICT_NO_SOCKET);
	count(id, length, FANOUT_XDP_VERDICT_REDIRECTED);
	return XDP_REDIRECT;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
