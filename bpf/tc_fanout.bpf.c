// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * tc ingress program of udp-fanout's tc_ebpf mode: each UDP datagram to a listener's address
 * and port goes to one of the listener's backends, rewritten and redirected in the kernel.
 *
 * Parse Ethernet (one 802.1Q/802.1ad tag), IPv4 (with options) or IPv6 (with extension
 * headers), UDP, with the shared parser (bpf/include/parse.h; checksum helpers in csum.h). Match the arrival interface and destination against the listeners map (exact
 * address first, then the family's wildcard). Pick a backend: per-CPU weighted rotation or a source-address
 * lookup table (Sources/FanoutCore/Balancing/SourceTable.swift). Look up the route to the backend (bpf_fib_lookup), then rewrite destination
 * address and port with incremental checksum updates (a zero IPv4 UDP checksum stays zero),
 * decrement TTL / hop limit, and redirect. The source address is not touched (one-way and the
 * client direction of a nat listener; a nat listener's replies get their source rewritten).
 *
 * Fragments: the first fragment's choice is remembered by (source, destination, IP id) and
 * later fragments follow it, so a datagram is reassembled whole at one backend.
 *
 * Replication (`pools:`, fanout_pools.h): each datagram of a listener with pools is first copied
 * to every pool that takes it (bpf_clone_redirect, the client's source kept), then its own
 * datagram leaves as above; fragments follow their first fragment's pools too.
 *
 * Two-way listeners (fanout_listener.reserved & FANOUT_LISTENER_NAT, `replies: nat`): a client
 * keeps its backend through the listener's association map (an LRU hash, inner map of
 * FANOUT_MAP_ASSOCIATIONS at the listener's id) while that backend is live (FANOUT_MAP_LIVE).
 * A datagram that matches no listener but comes from a live backend is a reply: to the client
 * associated with that backend it leaves from the listener's address and port (source NAT,
 * checksums, TTL, fib, redirect); to a client of another backend it is dropped (WRONG_SERVER);
 * to a client with no association it creates one (server initiated) and leaves the same way.
 * A backend that left the set drains (FANOUT_LIVE_DRAINING): no new client, its clients move on
 * their next datagram, and its replies to them still leave from the listener's address until
 * userspace marks it gone after settings.drain_secs (FANOUT_LIVE_GONE: dropped, DRAINED).
 *
 * Everything that is not a datagram for a listener passes untouched and continues down the
 * chain (FANOUT_PASS). Every other outcome is a counted verdict (enum fanout_verdict).
 *
 * This file holds the program itself: what is done in which order and what is counted. The
 * maps are in bpf/include/fanout_maps.h, the choice of a backend in fanout_choice.h, the
 * reply direction in fanout_nat.h, route, rewrite and redirect in fanout_redirect.h.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_maps.h"   /* the maps and their counter accessors */
#include "fanout_choice.h"    /* listener, backend (rotation, source table, association), fragment key */
#include "fanout_nat.h"       /* the reply direction of nat listeners */
#include "fanout_redirect.h"  /* route, VLAN pop, rewrite with checksums, MACs, redirect */
#include "fanout_pools.h"     /* replication: each datagram copied to the listener's pools */

/* VLAN tags accepted in the frame: one (the tag is popped before the redirect). */
#define FANOUT_TC_VLAN_TAGS 1

/* Not ours: continue down the chain. TC_ACT_OK would end it, so every later clsact filter
 * and TCX program (firewalls, Cilium) would never see the packet; TC_ACT_UNSPEC is TCX_NEXT
 * for a TCX link and "next filter" for cls_bpf, and when nothing follows the kernel passes
 * the packet to the stack as with TC_ACT_OK. */
#define FANOUT_PASS TC_ACT_UNSPEC

/* Bytes made linear when headers lie outside the skb's head: the rewrite's L4 bound (512)
 * plus the UDP header. */
#define FANOUT_PULL_BYTES 520

static __always_inline enum parsed parse(struct __sk_buff *skb, struct packet *p)
{
	return parse_frame((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, FANOUT_TC_VLAN_TAGS, p);
}

/* Makes the headers direct-access when the driver left them in page fragments (a short
 * copied head, header split): only the linear area lies between skb->data and data_end.
 * Returns whether anything was pulled, so the caller parses again. Up to the longest headers
 * the rewrite handles (L4 offset 512, UDP header 8), never past the packet. */
static __always_inline int pull_headers(struct __sk_buff *skb)
{
	__u32 linear = skb->data_end - skb->data;
	__u32 length = skb->len;
	if (linear >= length)
		return 0;
	__u32 want = length < FANOUT_PULL_BYTES ? length : FANOUT_PULL_BYTES;
	if (want <= linear)
		return 0;
	return bpf_skb_pull_data(skb, want) == 0;
}

/* A first fragment's decision, for its later fragments: the backend it left for (own_verdict
 * FORWARDED), or, when it did not but the listener's pools took it, what became of it, and the
 * pools' decisions (`work`, the per-CPU scratch; NULL without pools). Nothing for a packet that
 * is not a first fragment. */
static __always_inline void remember_fragment(struct packet *p, struct fanout_fragment_key *key,
					      struct fanout_backend *backend, __u32 id, int reply,
					      __u32 own_verdict, struct fanout_fragment *work)
{
	if (!p->has_udp || !p->fragment)
		return;
	if (own_verdict != FANOUT_VERDICT_FORWARDED && !work)
		return;
	struct fanout_fragment *remembered = work ? work : pool_scratch();
	if (!remembered)
		return;
	if (!work)
		remembered->pool_count = 0;
	remembered->backend = *backend;
	remembered->listener_id = id;
	remembered->direction = reply ? FANOUT_DIRECTION_REPLY : FANOUT_DIRECTION_FORWARD;
	remembered->own_verdict = own_verdict;
	bpf_map_update_elem(&FANOUT_MAP_FRAGMENTS, key, remembered, BPF_ANY);
}

SEC("tc")
int FANOUT_PROG_TC(struct __sk_buff *skb)
{
	struct packet p = {};
	enum parsed parsed = parse(skb, &p);
	/* Headers cut short in the linear area but present in the packet: pull and look again. */
	if (parsed == PARSED_MALFORMED && pull_headers(skb)) {
		__builtin_memset(&p, 0, sizeof(p));
		parsed = parse(skb, &p);
	}
	if (parsed == PARSED_OTHER) {
		count_unmatched(FANOUT_VERDICT_NOT_OURS);
		return FANOUT_PASS;
	}
	if (parsed == PARSED_MALFORMED) {
		count_unmatched(FANOUT_VERDICT_MALFORMED);
		return FANOUT_PASS;
	}

	struct fanout_fragment_key fragment_key = {};
	fill_fragment_key(skb->ifindex, &p, &fragment_key);

	/* Forward: the backend (the new destination). Reply: the listener's address and port (the
	 * new source), with the replying backend's counter slot. */
	struct fanout_backend backend = {};
	__u32 id = 0;
	int chosen = 1;
	int reply = 0;
	int wrong_server = 0;
	int drained = 0;
	int new_association = 0;
	__u32 event = ASSOCIATION_KEPT;
	__u32 reply_moved = 0;
	/* Replication: the pools' decisions (per-CPU scratch), and for a later fragment what became
	 * of its first fragment at the listener's own backend. */
	struct fanout_fragment *work = NULL;
	__u32 own_verdict = FANOUT_VERDICT_FORWARDED;
	/* 1 until the TTL / hop limit was decremented (by a pool's copy, or the own rewrite). */
	__u32 hop = 1;
	if (p.has_udp) {
		struct fanout_listener *listener = find_listener(skb->ifindex, &p);
		if (listener) {
			id = listener->id;
			if (listener->reserved & FANOUT_LISTENER_NAT)
				chosen = choose_associated(listener, &p, &backend, &event);
			else
				chosen = choose(listener, &p, &backend);
			if (listener->pool_count) {
				work = pool_scratch();
				if (work)
					decide_pools(listener, &p, skb->len, work);
			}
		} else {
			int found = find_reply(&p, &backend, &id, &reply_moved);
			if (found == REPLY_NOT_OURS) {
				count_unmatched(FANOUT_VERDICT_NOT_OURS);
				return FANOUT_PASS;
			}
			reply = 1;
			wrong_server = found == REPLY_WRONG_SERVER;
			drained = found == REPLY_DRAINED;
			new_association = found == REPLY_NEW;
		}
	} else {
		struct fanout_fragment *remembered = bpf_map_lookup_elem(&FANOUT_MAP_FRAGMENTS, &fragment_key);
		if (!remembered) {
			count_unmatched(FANOUT_VERDICT_FRAGMENT_UNTRACKED);
			return FANOUT_PASS;
		}
		backend = remembered->backend;
		id = remembered->listener_id;
		reply = remembered->direction == FANOUT_DIRECTION_REPLY;
		own_verdict = remembered->own_verdict;
		if (!reply && remembered->pool_count) {
			work = pool_scratch();
			if (work) {
				work->pool_count = remembered->pool_count;
				__builtin_memcpy(work->pools, remembered->pools, sizeof(work->pools));
				count_decisions(work, skb->len);
			}
		}
	}
	/* Neither happens (ids are bounded by userspace, the array has every id): counted anyway,
	 * so that every packet has a verdict. */
	struct fanout_stats *stats = id < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_STATS, &id) : NULL;
	if (!stats) {
		count_unmatched(FANOUT_VERDICT_NOT_OURS);
		return FANOUT_PASS;
	}
	if (reply) {
		if (wrong_server) {
			count(stats, reply, FANOUT_VERDICT_WRONG_SERVER);
			return TC_ACT_SHOT;
		}

	} else {
		stats->received++;
		stats->bytes_received += skb->len;
		if (event == ASSOCIATION_CREATED)
			stats->created++;
		else if (event == ASSOCIATION_MOVED)
			stats->moved++;
		/* The pools' copies first: the listener's own datagram leaves last, rewritten from the
		 * last copy's destination (or not at all). */
		if (work && send_copies(skb, &p, work, &hop) < 0)
			goto failed;
		if (!chosen) {
			count(stats, reply, FANOUT_VERDICT_NO_BACKEND);
			remember_fragment(&p, &fragment_key, &backend, id, reply, FANOUT_VERDICT_NO_BACKEND, work);
			return TC_ACT_SHOT;
		}
		/* A later fragment whose first did not leave for the listener's own backend. */
		if (own_verdict != FANOUT_VERDICT_FORWARDED && own_verdict < FANOUT_VERDICT_COUNT) {
			count(stats, reply, own_verdict);
			return TC_ACT_SHOT;
		}
	}

	__u32 verdict;
	/* A gone backend's datagram is counted drained (below, once known not to be for this host). */
	if (p.hop_limit <= 1 && !drained) {
		count(stats, reply, FANOUT_VERDICT_TTL_EXPIRED);
		return TC_ACT_SHOT;
	}

	struct bpf_fib_lookup fib = {};
	long route = lookup_route(skb, &p, &backend, reply, &fib);
	/* A backend's datagram to this host itself (a udp_echo health probe's answer, say) is no
	 * reply to a client: it goes up the stack untouched, and associates nothing. */
	if (reply && route == BPF_FIB_LKUP_RET_NOT_FWDED) {
		count_unmatched(FANOUT_VERDICT_NOT_OURS);
		return FANOUT_PASS;
	}
	/* A backend whose drain ended: what it sends toward a client is dropped, counted (after the
	 * check above, so its datagrams to this host itself still pass). */
	if (drained) {
		count(stats, reply, FANOUT_VERDICT_DRAINED);
		return TC_ACT_SHOT;
	}
	if (route == BPF_FIB_LKUP_RET_SUCCESS)
		verdict = FANOUT_VERDICT_FORWARDED;
	else if (route == BPF_FIB_LKUP_RET_NO_NEIGH)
		verdict = FANOUT_VERDICT_FORWARDED_NEIGH;
	else if (route == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		verdict = FANOUT_VERDICT_TOO_LARGE;
	else
		verdict = FANOUT_VERDICT_NO_ROUTE;
	if (verdict != FANOUT_VERDICT_FORWARDED && verdict != FANOUT_VERDICT_FORWARDED_NEIGH) {
		count(stats, reply, verdict);
		struct fanout_backend_stats *dropped = reply ? NULL : backend_stats(id, backend.counter_slot);
		if (dropped) {
			if (verdict == FANOUT_VERDICT_NO_ROUTE)
				dropped->no_route++;
			else
				dropped->too_large++;
		}
		if (!reply)
			remember_fragment(&p, &fragment_key, &backend, id, reply, verdict, work);
		return TC_ACT_SHOT;
	}

	if (new_association)
		associate_reply(&p, id, stats, reply_moved);
	/* Later fragments follow the first one's choice (only once it is known to leave). */
	remember_fragment(&p, &fragment_key, &backend, id, reply, FANOUT_VERDICT_FORWARDED, work);

	if (pop_vlan(skb, &p) < 0)
		goto failed;
	if (rewrite(skb, &p, &backend, reply, hop) < 0)
		goto failed;

	long redirected;
	if (verdict == FANOUT_VERDICT_FORWARDED) {
		if (write_macs(skb, &fib) < 0)
			goto failed;
		redirected = bpf_redirect(fib.ifindex, 0);
	} else {
		redirected = redirect_neigh(&p, &fib);
	}
	if (redirected != TC_ACT_REDIRECT)
		goto failed;
	struct fanout_backend_stats *per_backend = backend_stats(id, backend.counter_slot);
	if (reply) {
		count(stats, reply, FANOUT_VERDICT_REPLIED);
		stats->reply_bytes += skb->len;
		if (per_backend) {
			per_backend->replies++;
			per_backend->reply_bytes += skb->len;
		}
		return TC_ACT_REDIRECT;
	}
	count(stats, reply, verdict);
	stats->bytes_forwarded += skb->len;
	if (per_backend) {
		per_backend->packets++;
		per_backend->bytes += skb->len;
	}
	return TC_ACT_REDIRECT;

failed:
	count(stats, reply, FANOUT_VERDICT_REWRITE_FAILED);
	return TC_ACT_SHOT;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
