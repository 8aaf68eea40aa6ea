/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * udp-fanout af_xdp mode: every type, constant and name that crosses the kernel/user line of
 * the XDP steering program.
 *
 * Included by bpf/xdp_steer.bpf.c and imported by Swift through the BPFKernelABI module.
 * FANOUT_MAX_LISTENERS comes from fanout_shared.h (the same bound in both modes).
 */
#ifndef AFXDP_SHARED_H
#define AFXDP_SHARED_H

#include <linux/types.h>
#include "fanout_shared.h"

/* Receive queues per interface that can hold an AF_XDP socket (the XSKMAP's size): the
 * program redirects to the socket of the queue the frame arrived on. */
#define FANOUT_XDP_MAX_QUEUES 64

/* The stats entry of frames no listener could be known for (see the verdicts). */
#define FANOUT_XDP_UNMATCHED_STATS FANOUT_MAX_LISTENERS

#define FANOUT_PROG_XDP           fanout_xdp
#define FANOUT_PROG_XDP_NAME      "fanout_xdp"
#define FANOUT_MAP_XDP_LISTENERS  xdp_listen
#define FANOUT_MAP_XDP_LISTENERS_NAME "xdp_listen"
#define FANOUT_MAP_XDP_SOCKETS    xdp_xsks
#define FANOUT_MAP_XDP_SOCKETS_NAME "xdp_xsks"
#define FANOUT_MAP_XDP_STATS      xdp_stats
#define FANOUT_MAP_XDP_STATS_NAME "xdp_stats"

#define FANOUT_XDP_OPTIONS        fanout_xdp_options
#define FANOUT_XDP_OPTIONS_NAME   "fanout_xdp_options"

/* Options fixed at load time: a read-only global (.rodata) userspace sets before loading, so
 * the verifier sees constants. */
struct fanout_xdp_options {
	/* The longest frame (Ethernet header included) the AF_XDP socket's UMEM frame holds:
	 * longer ones pass to the kernel (FANOUT_XDP_VERDICT_TOO_LARGE). */
	__u32 max_frame_len;
	__u32 reserved;
};

/* What the program did with a frame: every frame gets exactly one, counted per listener (per
 * CPU), or in the FANOUT_XDP_UNMATCHED_STATS entry when no listener can be known. Nothing is
 * ever dropped: what the socket cannot take goes on to the kernel's stack (XDP_PASS). */
enum fanout_xdp_verdict {
	/* a listener's whole datagram, redirected to the AF_XDP socket of its receive queue */
	FANOUT_XDP_VERDICT_REDIRECTED = 0,
	/* a listener's datagram, but no socket is in the XSKMAP for the receive queue: passed */
	FANOUT_XDP_VERDICT_NO_SOCKET = 1,
	/* an IPv4/IPv6 fragment (first or later): passed, the kernel reassembles it for the
	 * listener's companion UDP socket. A first fragment is counted for its listener; a
	 * later one, which carries no port, in the unmatched entry. */
	FANOUT_XDP_VERDICT_FRAGMENT = 2,
	/* a listener's datagram in a frame longer than max_frame_len: passed */
	FANOUT_XDP_VERDICT_TOO_LARGE = 3,
	/* an IPv4/IPv6 packet whose headers end early or are invalid: passed (unmatched entry) */
	FANOUT_XDP_VERDICT_MALFORMED = 4,
	/* not a UDP datagram for a listener on this interface (ARP, TCP, ICMP, other ports,
	 * addresses, interfaces, more VLAN tags): passed (unmatched entry) */
	FANOUT_XDP_VERDICT_NOT_OURS = 5,
	FANOUT_XDP_VERDICT_COUNT = 6,
};

/* Key of the listeners map: the interface the frame arrived on (ctx->ingress_ifindex),
 * destination address and port as they lie in the packet. An unspecified address (all zero)
 * matches every destination address of that family on that interface. */
struct fanout_xdp_listener_key {
	__u32 ifindex;
	__u32 addr[4];   /* IPv4: addr[0], the rest 0 */
	__u16 port;      /* network order */
	__u8 family;     /* AF_INET or AF_INET6 */
	__u8 pad;
};

/* Value of the listeners map. */
struct fanout_xdp_listener {
	__u32 id;       /* < FANOUT_MAX_LISTENERS: the stats key */
	__u32 flags;    /* reserved, 0 */
};

/* What the program found in a frame it redirects to an AF_XDP socket, written in the frame's
 * metadata area (bpf_xdp_adjust_meta) so that userspace takes the program's parse instead of
 * walking the headers again. It lies right before the frame's first byte, `magic` last; the
 * forwarder reads it and clears `magic` (a frame without metadata, where the driver has no
 * metadata area, is parsed in userspace). Offsets are from the start of the frame. */
#define FANOUT_XDP_META_MAGIC 0xfa0d0e7aU
struct fanout_xdp_meta {
	__u16 l3;         /* the IP header */
	__u16 l4;         /* the UDP header */
	__u16 ip_end;     /* the end of the IP packet (l3 + its length): Ethernet padding follows */
	__u8 family;      /* AF_INET or AF_INET6 */
	__u8 hop_limit;   /* IPv4 TTL or IPv6 hop limit */
	__u32 magic;      /* FANOUT_XDP_META_MAGIC */
};

/* Per-CPU counters of one listener (or of the unmatched entry). received and bytes count
 * every frame counted here, so received is the sum of the verdicts. */
struct fanout_xdp_stats {
	__u64 received;
	__u64 bytes;
	__u64 verdicts[FANOUT_XDP_VERDICT_COUNT];
};

#endif /* AFXDP_SHARED_H */
