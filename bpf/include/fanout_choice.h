/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * Choosing a downstream (backend) in the tc and xdp programs (bpf/tc_fanout.bpf.c, bpf/xdp_fanout.bpf.c): the listener a
 * datagram is for (find_listener: arrival interface and destination, exact address first, then
 * the family's wildcard), the backend of the listener's current set by its policy (choose:
 * per-CPU weighted rotation, or the source-address table hashed with rplb_shared.h's
 * rplb_source_hash and rplb_reduce), a nat listener's client kept on its associated backend
 * while that backend is live (choose_associated, with enum association_event for the counters),
 * and the key under which a fragmented datagram's choice is remembered for its later fragments
 * (fill_fragment_key). Reads the maps of fanout_maps.h. Self-contained: includes
 * linux/bpf.h, bpf_helpers.h, rplb_shared.h, fanout_shared.h, parse.h (struct packet,
 * AF_INET) and fanout_maps.h itself, so nothing has to come before it; like
 * fanout_maps.h, for the programs that share the tc program's maps only.
 */
#ifndef FANOUT_CHOICE_H
#define FANOUT_CHOICE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "rplb_shared.h"
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_maps.h"

/* The listener of a datagram that arrived at interface `ifindex` (skb->ifindex at tc ingress,
 * ctx->ingress_ifindex at XDP). */
static __always_inline struct fanout_listener *find_listener(__u32 ifindex, struct packet *p)
{
	struct fanout_listener_key key = {};
	key.ifindex = ifindex;
	key.family = p->family;
	key.port = p->dport;
	__builtin_memcpy(key.addr, p->daddr, sizeof(key.addr));
	struct fanout_listener *listener = bpf_map_lookup_elem(&FANOUT_MAP_LISTENERS, &key);
	if (listener)
		return listener;
	__builtin_memset(key.addr, 0, sizeof(key.addr));
	return bpf_map_lookup_elem(&FANOUT_MAP_LISTENERS, &key);
}

/* The index of the backend for this packet in the set of `id` at `generation`, by `policy`
 * (rotation or source table), or -1 if none; the set into `*found`. A listener's and a
 * replication pool's choice alike. */
static __always_inline int choose_index(__u32 id, __u32 generation, __u32 policy, struct packet *p,
					struct fanout_set **found)
{
	__u32 set_key = id * 2 + (generation & 1);
	struct fanout_set *set = bpf_map_lookup_elem(&FANOUT_MAP_SETS, &set_key);
	if (!set)
		return -1;
	__u32 index;
	if (policy == FANOUT_POLICY_SOURCE_IP) {
		__u32 size = set->table_size;
		if (size == 0 || size > FANOUT_TABLE_SIZE)
			return -1;
		__u32 hash = rplb_source_hash(p->saddr, p->family == AF_INET ? 1 : 4, 0, set->seed, 0);
		__u32 position = rplb_reduce(hash, size);
		if (position >= FANOUT_TABLE_SIZE)
			return -1;
		index = set->table[position];
	} else {
		__u32 key = id;
		__u32 *next = bpf_map_lookup_elem(&FANOUT_MAP_RR, &key);
		__u32 length = set->rotation_len;
		if (!next || length == 0 || length > FANOUT_ROTATION_MAX)
			return -1;
		__u32 position = *next;
		if (position >= length)
			position = 0;
		*next = position + 1;
		if (position >= FANOUT_ROTATION_MAX)
			return -1;
		index = set->rotation[position];
	}
	if (index >= set->count || index >= FANOUT_MAX_BACKENDS)
		return -1;
	*found = set;
	return index;
}

/* The backend for this packet, copied out of the set, or 0 if none. */
static __always_inline int choose(struct fanout_listener *listener, struct packet *p,
				  struct fanout_backend *chosen)
{
	struct fanout_set *set = NULL;
	int index = choose_index(listener->id, listener->generation, listener->policy, p, &set);
	if (index < 0 || index >= FANOUT_MAX_BACKENDS || !set)
		return 0;
	*chosen = set->backends[index];
	return 1;
}

static __always_inline int same_backend(struct fanout_association *associated, struct fanout_backend *backend)
{
	return associated->addr[0] == backend->addr[0] && associated->addr[1] == backend->addr[1] &&
	       associated->addr[2] == backend->addr[2] && associated->addr[3] == backend->addr[3] &&
	       associated->port == backend->port;
}

/* What choose_associated did to the listener's association map (counted once the listener's
 * stats are at hand). */
enum association_event {
	ASSOCIATION_KEPT = 0,
	ASSOCIATION_CREATED = 1,
	ASSOCIATION_MOVED = 2,
};

/* A nat listener's backend for this client: its association while that backend is live for
 * this listener, else a new choice by the listener's balancing, remembered. `routed`: quic_lb
 * chose `chosen` by connection ID, and the client is associated with it whatever it was before
 * (a client whose ID names another backend moves there: its server is there). */
static __always_inline int choose_associated(struct fanout_listener *listener, struct packet *p,
					     struct fanout_backend *chosen, __u32 *event, int routed)
{
	__u32 id = listener->id;
	void *associations = bpf_map_lookup_elem(&FANOUT_MAP_ASSOCIATIONS, &id);
	if (!associations)
		return routed || choose(listener, p, chosen); /* not set up (yet): one-way */
	struct fanout_association_key key = {};
	__builtin_memcpy(key.addr, p->saddr, sizeof(key.addr));
	key.port = p->sport;
	key.family = p->family;
	struct fanout_association *associated = bpf_map_lookup_elem(associations, &key);
	__u32 happened = ASSOCIATION_CREATED;
	__u16 drained_slot = 0;
	if (associated && routed) {
		if (same_backend(associated, chosen))
			return 1;
	} else if (associated) {
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
	}
	if (associated)
		happened = ASSOCIATION_MOVED;
	if (!routed && !choose(listener, p, chosen))
		return 0;
	struct fanout_association value = {};
	__builtin_memcpy(value.addr, chosen->addr, sizeof(value.addr));
	value.port = chosen->port;
	value.drained_slot = drained_slot;
	bpf_map_update_elem(associations, &key, &value, BPF_ANY);
	*event = happened;
	return 1;
}

/* Fragments: the first fragment's choice is remembered by (source, destination, IP id) at the
 * arrival interface, and later fragments follow it. The key of this packet's datagram, into
 * `key` (zeroed by the caller), when the packet is a fragment; left zero otherwise. */
static __always_inline void fill_fragment_key(__u32 ifindex, struct packet *p,
					      struct fanout_fragment_key *key)
{
	if (p->fragment) {
		__builtin_memcpy(key->saddr, p->saddr, sizeof(p->saddr));
		__builtin_memcpy(key->daddr, p->daddr, sizeof(p->daddr));
		key->id = p->id;
		key->ifindex = ifindex;
		key->family = p->family;
	}
}

#endif /* FANOUT_CHOICE_H */
