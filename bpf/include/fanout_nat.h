/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The reply direction of the tc program's two-way (nat) listeners (bpf/tc_fanout.bpf.c; see
 * docs/two-way-nat.md): a datagram that matched no listener is a reply if its source is a live
 * backend of a nat listener (find_reply, whose enum reply_kind tells the program what to do
 * with it), and a reply that leaves associates its client with that backend (associate;
 * associate_reply also counts it). The client direction's association (choose_associated) is in
 * fanout_choice.h. Reads and writes the live, nat and association maps of fanout_maps.h.
 * Self-contained: includes linux/bpf.h, bpf_helpers.h, fanout_shared.h, parse.h (struct
 * packet) and fanout_maps.h itself, so nothing has to come before it; like fanout_maps.h,
 * for the tc program only.
 */
#ifndef FANOUT_NAT_H
#define FANOUT_NAT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_maps.h"

static __always_inline int same_endpoint(const __u32 *a, __u16 a_port, const __u32 *b, __u16 b_port)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a_port == b_port;
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
	REPLY_SHARED = 6,       /* a quic_lb listener's live backend to a client associated with
				 * another live backend (FANOUT_NAT_QUIC): leaves, associates nothing */
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
		return nat->enabled & FANOUT_NAT_QUIC ? REPLY_SHARED : REPLY_WRONG_SERVER;
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

/* Once a reply with no association (REPLY_NEW) is known to leave: associates its client with
 * the replying backend and counts how the association came about (its client moved from a
 * backend that left the set, or the backend spoke first: server initiated). */
static __always_inline void associate_reply(struct packet *p, __u32 id, struct fanout_stats *stats, __u32 moved)
{
	associate(p, id);
	if (moved)
		stats->moved++;
	else
		stats->server_initiated++;
}

#endif /* FANOUT_NAT_H */
