// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
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
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "rplb_shared.h"
#include "fanout_tc_shared.h"
#include "parse.h"
#include "csum.h"

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

const volatile struct fanout_tc_options FANOUT_OPTIONS = {};

/* Counts a packet no listener could be known for. */
static __always_inline void count_unmatched(__u32 verdict)
{
	__u32 key = FANOUT_UNMATCHED_STATS;
	struct fanout_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_STATS, &key);
	if (stats && verdict < FANOUT_VERDICT_COUNT)
		stats->verdicts[verdict]++;
}

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

static __always_inline struct fanout_listener *find_listener(struct __sk_buff *skb, struct packet *p)
{
	struct fanout_listener_key key = {};
	key.ifindex = skb->ifindex;
	key.family = p->family;
	key.port = p->dport;
	__builtin_memcpy(key.addr, p->daddr, sizeof(key.addr));
	struct fanout_listener *listener = bpf_map_lookup_elem(&FANOUT_MAP_LISTENERS, &key);
	if (listener)
		return listener;
	__builtin_memset(key.addr, 0, sizeof(key.addr));
	return bpf_map_lookup_elem(&FANOUT_MAP_LISTENERS, &key);
}

/* The per-CPU counters of one backend slot of a listener, or NULL. */
static __always_inline struct fanout_backend_stats *backend_stats(__u32 id, __u32 slot)
{
	if (slot >= FANOUT_MAX_BACKENDS || id >= FANOUT_MAX_LISTENERS)
		return NULL;
	__u32 key = id * FANOUT_MAX_BACKENDS + slot;
	return bpf_map_lookup_elem(&FANOUT_MAP_BACKEND_STATS, &key);
}

/* The backend for this packet, copied out of the set, or 0 if none. */
static __always_inline int choose(struct fanout_listener *listener, struct packet *p,
				  struct fanout_backend *chosen)
{
	__u32 set_key = listener->id * 2 + (listener->generation & 1);
	struct fanout_set *set = bpf_map_lookup_elem(&FANOUT_MAP_SETS, &set_key);
	if (!set)
		return 0;
	__u32 index;
	if (listener->policy == FANOUT_POLICY_SOURCE_IP) {
		__u32 size = set->table_size;
		if (size == 0 || size > FANOUT_TABLE_SIZE)
			return 0;
		__u32 hash = rplb_source_hash(p->saddr, p->family == AF_INET ? 1 : 4, 0, set->seed, 0);
		__u32 position = rplb_reduce(hash, size);
		if (position >= FANOUT_TABLE_SIZE)
			return 0;
		index = set->table[position];
	} else {
		__u32 key = listener->id;
		__u32 *next = bpf_map_lookup_elem(&FANOUT_MAP_RR, &key);
		__u32 length = set->rotation_len;
		if (!next || length == 0 || length > FANOUT_ROTATION_MAX)
			return 0;
		__u32 position = *next;
		if (position >= length)
			position = 0;
		*next = position + 1;
		if (position >= FANOUT_ROTATION_MAX)
			return 0;
		index = set->rotation[position];
	}
	if (index >= set->count || index >= FANOUT_MAX_BACKENDS)
		return 0;
	*chosen = set->backends[index];
	return 1;
}

/* What choose_associated did to the listener's association map (counted once the listener's
 * stats are at hand). */
enum association_event {
	ASSOCIATION_KEPT = 0,
	ASSOCIATION_CREATED = 1,
	ASSOCIATION_MOVED = 2,
};

static __always_inline int same_endpoint(const __u32 *a, __u16 a_port, const __u32 *b, __u16 b_port)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a_port == b_port;
}

/* A nat listener's backend for this client: its association while that backend is live for
 * this listener, else a new choice by the listener's balancing, remembered. */
static __always_inline int choose_associated(struct fanout_listener *listener, struct packet *p,
					     struct fanout_backend *chosen, __u32 *event)
{
	__u32 id = listener->id;
	void *associations = bpf_map_lookup_elem(&FANOUT_MAP_ASSOCIATIONS, &id);
	if (!associations)
		return choose(listener, p, chosen); /* not set up (yet): one-way */
	struct fanout_association_key key = {};
	__builtin_memcpy(key.addr, p->saddr, sizeof(key.addr));
	key.port = p->sport;
	key.family = p->family;
	struct fanout_association *associated = bpf_map_lookup_elem(associations, &key);
	__u32 happened = ASSOCIATION_CREATED;
	__u16 drained_slot = 0;
	if (associated) {
		struct fanout_live_key live_key = {};
		__builtin_memcpy(live_key.addr, associated->addr, sizeof(live_key.addr));
		live_key.port = associated->port;
		live_key.family = p->family;
		struct fanout_live *live = bpf_map_lookup_elem(&FANOUT_MAP_LIVE, &live_key);
		if (live && live->listener_id == id) {
			if (live->state == FANOUT_LIVE_ACTIVE) {
				__builtin_memcpy(chosen->addr, live_key.addr, sizeof(chosen->addr));
				chosen->port = live_key.port;
				chosen->counter_slot = live->counter_slot;
				return 1;
			}
			/* Its backend drains: the client moves, and that backend's replies in flight
			 * still reach it until the drain ends. */
			if (live->state == FANOUT_LIVE_DRAINING)
				drained_slot = live->counter_slot + 1;
		}
		happened = ASSOCIATION_MOVED;
	}
	if (!choose(listener, p, chosen))
		return 0;
	struct fanout_association value = {};
	__builtin_memcpy(value.addr, chosen->addr, sizeof(value.addr));
	value.port = chosen->port;
	value.drained_slot = drained_slot;
	bpf_map_update_elem(associations, &key, &value, BPF_ANY);
	*event = happened;
	return 1;
}

/* What find_reply found. */
enum reply_kind {
	REPLY_NOT_OURS = 0,     /* not from a live backend of a nat listener */
	REPLY_ASSOCIATED = 1,   /* to this backend's client */
	REPLY_WRONG_SERVER = 2, /* to a client of another live backend */
	REPLY_NEW = 3,          /* to a client with no association (server-initiated), or whose
				 * backend left the set (moved): associated with this backend once
				 * the datagram is known to leave (not for this host) */
	REPLY_DRAINING = 4,     /* from a draining backend to a client it served: leaves from the
				 * listener's address, associates nothing */
	REPLY_DRAINED = 5,      /* from a backend whose drain ended: dropped and counted */
};

/* A datagram that matched no listener: a reply if its source is a live backend of a nat
 * listener. Fills the listener's address and port (the new source) into `vip`, with the
 * backend's counter slot, and the listener id. Associates nothing: see associate(). */
static __always_inline int find_reply(struct packet *p, struct fanout_backend *vip, __u32 *id, __u32 *moved)
{
	struct fanout_live_key live_key = {};
	__builtin_memcpy(live_key.addr, p->saddr, sizeof(live_key.addr));
	live_key.port = p->sport;
	live_key.family = p->family;
	struct fanout_live *live = bpf_map_lookup_elem(&FANOUT_MAP_LIVE, &live_key);
	if (!live)
		return REPLY_NOT_OURS;
	__u32 listener = live->listener_id;
	__u16 slot = live->counter_slot;
	struct fanout_nat *nat = bpf_map_lookup_elem(&FANOUT_MAP_NAT, &listener);
	if (!nat || !nat->enabled || nat->family != p->family)
		return REPLY_NOT_OURS;
	void *associations = bpf_map_lookup_elem(&FANOUT_MAP_ASSOCIATIONS, &listener);
	if (!associations)
		return REPLY_NOT_OURS;
	*id = listener;
	__builtin_memcpy(vip->addr, nat->addr, sizeof(vip->addr));
	vip->port = nat->port;
	vip->counter_slot = slot;
	struct fanout_association_key key = {};
	__builtin_memcpy(key.addr, p->daddr, sizeof(key.addr));
	key.port = p->dport;
	key.family = p->family;
	if (live->state == FANOUT_LIVE_GONE)
		return REPLY_DRAINED;
	struct fanout_association *associated = bpf_map_lookup_elem(associations, &key);
	int draining = live->state == FANOUT_LIVE_DRAINING;
	if (!associated)
		return draining ? REPLY_DRAINING : REPLY_NEW;
	if (same_endpoint(associated->addr, associated->port, p->saddr, p->sport))
		return draining ? REPLY_DRAINING : REPLY_ASSOCIATED;
	/* A draining backend's reply to the client that moved away from it. */
	if (draining && associated->drained_slot == slot + 1)
		return REPLY_DRAINING;
	/* Another backend's client: sbulb's rule drops it, unless that backend left the set (the
	 * client would move on its next datagram anyway: it moves to this one now). */
	struct fanout_live_key other = {};
	__builtin_memcpy(other.addr, associated->addr, sizeof(other.addr));
	other.port = associated->port;
	other.family = p->family;
	struct fanout_live *other_live = bpf_map_lookup_elem(&FANOUT_MAP_LIVE, &other);
	if (other_live && other_live->listener_id == listener && other_live->state == FANOUT_LIVE_ACTIVE)
		return REPLY_WRONG_SERVER;
	/* A draining backend makes no new association: its reply leaves, the client stays. */
	if (draining)
		return REPLY_DRAINING;
	*moved = 1;
	return REPLY_NEW;
}

/* Associates the reply's client (destination) with its backend (source) in listener `id`'s map. */
static __always_inline void associate(struct packet *p, __u32 id)
{
	void *associations = bpf_map_lookup_elem(&FANOUT_MAP_ASSOCIATIONS, &id);
	if (!associations)
		return;
	struct fanout_association_key key = {};
	__builtin_memcpy(key.addr, p->daddr, sizeof(key.addr));
	key.port = p->dport;
	key.family = p->family;
	struct fanout_association value = {};
	__builtin_memcpy(value.addr, p->saddr, sizeof(value.addr));
	value.port = p->sport;
	bpf_map_update_elem(associations, &key, &value, BPF_ANY);
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

/* Writes the new destination, fixes the checksums, decrements TTL / hop limit.
 *
 * The UDP checksum goes through bpf_l4_csum_replace, which knows how the skb carries it
 * (CHECKSUM_PARTIAL holds only the pseudo-header sum; CHECKSUM_COMPLETE needs skb->csum
 * adjusted). Everything else is written directly: the IPv4 header checksum is updated in
 * place, which keeps the header's sum, and so skb->csum, unchanged. */
static __always_inline int rewrite(struct __sk_buff *skb, struct packet *p, struct fanout_backend *to, int reply)
{
	/* Forward: the destination address and port change; reply: the source. */
	__u32 *old_addr = reply ? p->saddr : p->daddr;
	__u16 old_port = reply ? p->sport : p->dport;
	__u32 csum = p->l4 + 6;
	if (p->has_udp) {
		long failed;
		if (p->family == AF_INET) {
			failed = bpf_l4_csum_replace(skb, csum, old_addr[0], to->addr[0],
						     BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(__u32));
		} else {
			__u64 diff = 0;
#pragma unroll
			for (int i = 0; i < 4; i++)
				diff += (__u32)~old_addr[i] + (__u64)to->addr[i];
			diff = (diff & 0xffffffff) + (diff >> 32);
			diff = (diff & 0xffffffff) + (diff >> 32);
			failed = bpf_l4_csum_replace(skb, csum, 0, (__u32)diff,
						     BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | FANOUT_OPTIONS.ipv6_csum_flags);
		}
		if (failed)
			return -1;
		if (to->port != old_port &&
		    bpf_l4_csum_replace(skb, csum, old_port, to->port, BPF_F_MARK_MANGLED_0 | sizeof(__u16)))
			return -1;
	}
	/* The helpers moved the packet: bounds again. */
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 l3 = p->l3, l4 = p->l4;
	if (l3 > 18 || l4 > 512)
		return -1;
	if (p->family == AF_INET) {
		__u8 *ip = data + l3;
		if ((void *)(ip + 20) > end)
			return -1;
		__u32 at = reply ? 12 : 16;
		__u16 check = *(__u16 *)(ip + 10);
		__u16 old_word = *(__u16 *)(ip + 8);
		ip[8] -= 1;
		check = csum_update16(check, old_word, *(__u16 *)(ip + 8));
		check = csum_update32(check, *(__u32 *)(ip + at), to->addr[0]);
		*(__u32 *)(ip + at) = to->addr[0];
		*(__u16 *)(ip + 10) = check;
	} else {
		__u8 *ip = data + l3;
		if ((void *)(ip + 40) > end)
			return -1;
		ip[7] -= 1;
		__builtin_memcpy(ip + (reply ? 8 : 24), to->addr, 16);
	}
	if (p->has_udp && to->port != old_port) {
		__u8 *udp = data + l4;
		if ((void *)(udp + 8) > end)
			return -1;
		*(__u16 *)(udp + (reply ? 0 : 2)) = to->port;
	}
	return 0;
}

/* Ethernet addresses from the fib lookup. */
static __always_inline int write_macs(struct __sk_buff *skb, struct bpf_fib_lookup *fib)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return -1;
	__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
	return 0;
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
	if (p.fragment) {
		__builtin_memcpy(fragment_key.saddr, p.saddr, sizeof(p.saddr));
		__builtin_memcpy(fragment_key.daddr, p.daddr, sizeof(p.daddr));
		fragment_key.id = p.id;
		fragment_key.ifindex = skb->ifindex;
		fragment_key.family = p.family;
	}

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
	if (p.has_udp) {
		struct fanout_listener *listener = find_listener(skb, &p);
		if (listener) {
			id = listener->id;
			if (listener->reserved & FANOUT_LISTENER_NAT)
				chosen = choose_associated(listener, &p, &backend, &event);
			else
				chosen = choose(listener, &p, &backend);
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
		if (!chosen) {
			count(stats, reply, FANOUT_VERDICT_NO_BACKEND);
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
	fib.family = p.family;
	fib.l4_protocol = IPPROTO_UDP;
	fib.sport = reply ? backend.port : p.sport;
	fib.dport = reply ? p.dport : backend.port;
	/* The route's MTU is checked against the IP length, so a packet the egress device would
	 * drop uncounted is dropped here as too_large. A GSO packet (GRO-merged) is checked by
	 * the kernel per segment on the way out: tot_len 0 skips the check. */
	if (skb->gso_size == 0)
		fib.tot_len = p.tot_len;
	fib.ifindex = skb->ifindex;
	/* Forward: from the client to the backend. Reply: from the listener's address to the client. */
	__u32 *source = reply ? backend.addr : p.saddr;
	__u32 *destination = reply ? p.daddr : backend.addr;
	if (p.family == AF_INET) {
		fib.ipv4_src = source[0];
		fib.ipv4_dst = destination[0];
	} else {
		__builtin_memcpy(fib.ipv6_src, source, 16);
		__builtin_memcpy(fib.ipv6_dst, destination, 16);
	}
	long route = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
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
		return TC_ACT_SHOT;
	}

	if (new_association) {
		associate(&p, id);
		if (reply_moved)
			stats->moved++;
		else
			stats->server_initiated++;
	}
	/* Later fragments follow the first one's choice (only once it is known to leave). */
	if (p.has_udp && p.fragment) {
		struct fanout_fragment remembered = {
			.backend = backend, .listener_id = id,
			.direction = reply ? FANOUT_DIRECTION_REPLY : FANOUT_DIRECTION_FORWARD,
		};
		bpf_map_update_elem(&FANOUT_MAP_FRAGMENTS, &fragment_key, &remembered, BPF_ANY);
	}

	/* A tag in the frame or in skb metadata belongs to the ingress link, not the egress. */
	if (p.tagged || skb->vlan_present) {
		if (bpf_skb_vlan_pop(skb) < 0)
			goto failed;
		if (p.tagged) {
			p.l3 -= 4;
			p.l4 -= 4;
		}
		if (p.tagged && skb->vlan_present && bpf_skb_vlan_pop(skb) < 0)
			goto failed;
	}
	if (rewrite(skb, &p, &backend, reply) < 0)
		goto failed;

	long redirected;
	if (verdict == FANOUT_VERDICT_FORWARDED) {
		if (write_macs(skb, &fib) < 0)
			goto failed;
		redirected = bpf_redirect(fib.ifindex, 0);
	} else {
		struct bpf_redir_neigh neighbour = {};
		if (p.family == AF_INET) {
			neighbour.nh_family = AF_INET;
			neighbour.ipv4_nh = fib.ipv4_dst;
		} else {
			neighbour.nh_family = AF_INET6;
			__builtin_memcpy(neighbour.ipv6_nh, fib.ipv6_dst, 16);
		}
		redirected = bpf_redirect_neigh(fib.ifindex, &neighbour, sizeof(neighbour), 0);
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
