/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The next-hop cache of the tc and xdp programs (fanout_hops.h), shared with userspace
 * (BPFKernelABI.h): what bpf_fib_lookup answered toward a listener's backend (a client's
 * datagram) or a replication pool's member (a copy; not a reply), kept per CPU by backend slot (at
 * the listener's id, or the pool's) and used
 * again while the route generation the daemon writes stays the same. The daemon
 * (TCRouteWatch.swift) writes a new generation whenever the kernel says its routes, rules,
 * neighbours, links, addresses, next hops or forwarding settings changed, and once a second
 * for what it does not say (a path MTU learned), each time with a deadline 3 seconds on: past
 * it (a daemon that stopped or hangs) the cache is off. It writes 0 (off: every datagram is
 * looked up) where one answer cannot serve every datagram to a destination (policy routing
 * rules, routes over several next hops or by source), and when it stops. Neither map is
 * handed to a restarted daemon: each process starts with the cache off until its own watch runs.
 */
#ifndef FANOUT_HOPS_SHARED_H
#define FANOUT_HOPS_SHARED_H

#include <linux/types.h>

#define FANOUT_MAP_ROUTE_STATE      fanout_rstate
#define FANOUT_MAP_ROUTE_STATE_NAME "fanout_rstate"
#define FANOUT_MAP_HOPS             fanout_hops
#define FANOUT_MAP_HOPS_NAME        "fanout_hops"

/* FANOUT_MAP_ROUTE_STATE's one entry (key 0), written by the daemon. */
struct fanout_route_state {
	__u32 generation;  /* 0: the cache is off; else the answers looked up at this generation hold */
	__u32 reserved;
	__u64 valid_until; /* CLOCK_MONOTONIC_COARSE ns (bpf_ktime_get_coarse_ns): off from then on */
};

/* One cached answer (FANOUT_MAP_HOPS, per CPU, key listener id * FANOUT_MAX_BACKENDS +
 * backend slot): the route toward `addr` of a datagram that arrived at `ifindex`. */
struct fanout_hop {
	__u32 addr[4];    /* the destination looked up, network order (IPv4: addr[0]) */
	__u32 generation; /* the route generation it was looked up at (0: none) */
	__u32 ifindex;    /* the arrival interface it was looked up from */
	__u32 egress;     /* the way out: bpf_fib_lookup's ifindex */
	__u16 mtu;        /* the route's MTU (0: not known, never used): a longer datagram is looked up */
	__u8 family;
	__u8 reserved;
	__u8 smac[6];
	__u8 dmac[6];
};

#endif /* FANOUT_HOPS_SHARED_H */
