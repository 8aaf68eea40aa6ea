/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * udp-fanout tc_ebpf and xdp modes: every type, constant and name that crosses the kernel/user
 * line.
 *
 * Included by bpf/tc_fanout.bpf.c, bpf/xdp_fanout.bpf.c (which runs with the tc program's maps)
 * and bpf/map_count.bpf.c, and imported by Swift through the BPFKernelABI module.
 */
#ifndef FANOUT_SHARED_H
#define FANOUT_SHARED_H

#include <linux/types.h>

/* Listeners one daemon serves in tc_ebpf mode (over all interfaces), and downstreams per
 * listener. Listener ids and backend counter slots are indexes below these bounds. */
#define FANOUT_MAX_LISTENERS 64
#define FANOUT_MAX_BACKENDS 64

/* Replication pools per listener (`pools:`, besides its own downstreams). A pool takes an id from
 * the listeners' (its sets at id*2 + generation, rotation, counters and member counter slots are
 * a listener's), so listeners and pools together are at most FANOUT_MAX_LISTENERS. */
#define FANOUT_MAX_POOLS 8

/* Source prefixes of every pool at once (`sources:`), in FANOUT_MAP_POOL_SOURCES. */
#define FANOUT_POOL_SOURCE_ENTRIES 4096

/* Seed of the sampling hash (`sample:`): PoolPlan.sampleSeed, so every kind and node keeps the
 * same sources of a sampled pool. */
#define FANOUT_SAMPLE_SEED 0x53414d50u

/* Longest weighted round-robin rotation (userspace scales weights to fit). */
#define FANOUT_ROTATION_MAX 1024

/* Source-IP lookup table size, the same in every udp-fanout mode: 255 entries per backend at the largest set. */
#define FANOUT_TABLE_SIZE 16381

/* Fragments of one datagram remembered at once (LRU: the oldest are forgotten first). */
#define FANOUT_FRAGMENT_ENTRIES 16384

/* The stats entry of packets that matched no listener yet were counted (see the verdicts). */
#define FANOUT_UNMATCHED_STATS FANOUT_MAX_LISTENERS

#define FANOUT_PROG_TC           fanout_tc
#define FANOUT_PROG_TC_NAME      "fanout_tc"
#define FANOUT_MAP_LISTENERS     fanout_listen
/* The layout of the tc program's maps as a whole (their keys, values, sizes and meaning): a
 * restarted daemon takes a previous process's maps over only when it is the same
 * (docs/restarts.md), else starts them anew and says what it lost. Raise it with any change to
 * a map or struct this header or fanout_maps.h defines. */
#define FANOUT_MAPS_LAYOUT 1

#define FANOUT_MAP_LISTENERS_NAME "fanout_listen"
#define FANOUT_MAP_SETS          fanout_sets
#define FANOUT_MAP_SETS_NAME     "fanout_sets"
#define FANOUT_MAP_RR            fanout_rr
#define FANOUT_MAP_RR_NAME       "fanout_rr"
#define FANOUT_MAP_FRAGMENTS     fanout_frags
#define FANOUT_MAP_FRAGMENTS_NAME "fanout_frags"
#define FANOUT_MAP_STATS         fanout_stats
#define FANOUT_MAP_STATS_NAME    "fanout_stats"
#define FANOUT_MAP_BACKEND_STATS fanout_bstats
#define FANOUT_MAP_BACKEND_STATS_NAME "fanout_bstats"
#define FANOUT_MAP_POOL_SOURCES  fanout_psrc
#define FANOUT_MAP_POOL_SOURCES_NAME "fanout_psrc"

/* Two-way listeners (`replies: nat`), see docs/two-way-nat.md. */
#define FANOUT_MAP_ASSOCIATIONS  fanout_assoc
#define FANOUT_MAP_ASSOCIATIONS_NAME "fanout_assoc"
#define FANOUT_MAP_LIVE          fanout_live
#define FANOUT_MAP_LIVE_NAME     "fanout_live"
#define FANOUT_MAP_NAT           fanout_nat
#define FANOUT_MAP_NAT_NAME      "fanout_nat"

/* settings.flow_templates in the kernel kinds (bpf/include/fanout_templates.h): a ring buffer
 * of the template-bearing datagrams of listeners with FANOUT_LISTENER_TEMPLATES, read by the
 * daemon, and their per-CPU counters by listener id (struct fanout_template_stats). Neither is
 * handed to the next process (a restart starts them anew; no other map changes). */
#define FANOUT_MAP_TEMPLATES     fanout_tpl
#define FANOUT_MAP_TEMPLATES_NAME "fanout_tpl"
#define FANOUT_MAP_TEMPLATE_STATS fanout_tplst
#define FANOUT_MAP_TEMPLATE_STATS_NAME "fanout_tplst"
/* The largest UDP payload passed to the daemon whole; a larger template-bearing one is counted
 * too_large and forwarded unread. */
#define FANOUT_TEMPLATE_DATA_MAX 2048
/* Sets read before the search for a template set gives up (templates come first in practice). */
#define FANOUT_TEMPLATE_SETS_MAX 16
#define FANOUT_TEMPLATE_RING_BYTES (1 << 20)

/* A template-bearing datagram for the daemon: its listener, source and UDP payload. */
struct fanout_template_event {
	__u32 listener_id;
	__u32 length;   /* bytes of `data`: the UDP payload */
	__u32 saddr[4]; /* as struct packet's */
	__u16 sport;    /* network order */
	__u8 family;
	__u8 reserved;
	__u32 reserved2;
	__u8 data[FANOUT_TEMPLATE_DATA_MAX];
};

struct fanout_template_stats {
	__u64 captured;   /* passed to the daemon */
	__u64 too_large;  /* longer than FANOUT_TEMPLATE_DATA_MAX: forwarded, not read */
	__u64 ring_full;  /* the ring buffer had no room (the daemon is behind): forwarded, not read */
	__u64 fragmented; /* a fragment of a version 9/10 datagram: forwarded, not read */
	__u64 sets_unread; /* FANOUT_TEMPLATE_SETS_MAX sets looked at, none a template set, more follow */
};

/* The xdp kind (`mode: xdp`, bpf/xdp_fanout.bpf.c): an XDP program in front of the tc program
 * at the same interfaces, loaded with the tc program's maps (one set of listeners, backend sets,
 * associations and counters), plus its own three below. What it cannot finish it passes to the
 * stack, where the tc program finishes it (enum fanout_xfwd_pass). */
#define FANOUT_PROG_XFWD         fanout_xfwd
#define FANOUT_PROG_XFWD_NAME    "fanout_xfwd"
/* By listener id (an ARRAY of __u32): 1 for the listeners (and their nat replies) the XDP
 * program serves; the tc program serves the others on the same interface. */
#define FANOUT_MAP_XFWD_IDS      fanout_xids
#define FANOUT_MAP_XFWD_IDS_NAME "fanout_xids"
/* The interfaces XDP may redirect to (a DEVMAP_HASH keyed by ifindex): those that transmit XDP
 * frames. A route through any other is finished by the tc program (FANOUT_XFWD_PASS_NO_XDP_XMIT). */
#define FANOUT_MAP_XFWD_DEVICES  fanout_xdevs
#define FANOUT_MAP_XFWD_DEVICES_NAME "fanout_xdevs"
#define FANOUT_XFWD_DEVICES      256
/* Per-CPU, by listener id (FANOUT_UNMATCHED_STATS: no listener known): struct fanout_xfwd_passed. */
#define FANOUT_MAP_XFWD_PASSED   fanout_xpass
#define FANOUT_MAP_XFWD_PASSED_NAME "fanout_xpass"

/* Why the XDP program passed a datagram of its listener on to the stack, where the tc program
 * at the same interface finishes it (and counts its verdict there). */
enum fanout_xfwd_pass {
	/* the fib lookup knows the route but not the next hop's Ethernet address: tc's
	 * bpf_redirect_neigh lets the kernel resolve it */
	FANOUT_XFWD_PASS_NO_NEIGHBOUR = 0,
	/* larger than the route's MTU: tc counts and drops it too_large (as the tc_ebpf kind) */
	FANOUT_XFWD_PASS_TOO_LARGE = 1,
	/* a later fragment whose first fragment did not leave at XDP (unseen, forgotten, or
	 * finished by tc): tc follows the first fragment, or counts it fragment_untracked */
	FANOUT_XFWD_PASS_FRAGMENT = 2,
	/* a listener with replication pools: tc makes the copies (bpf_clone_redirect has no XDP
	 * counterpart) */
	FANOUT_XFWD_PASS_POOLS = 3,
	/* the route leaves through an interface not in FANOUT_MAP_XFWD_DEVICES (it cannot transmit
	 * XDP frames, e.g. a veth whose peer has neither XDP nor GRO): tc redirects the skb */
	FANOUT_XFWD_PASS_NO_XDP_XMIT = 4,
	/* a UDP checksum that holds only the pseudo-header's sum (CHECKSUM_PARTIAL: a local
	 * sender through a veth, or generic XDP): XDP cannot tell the skb's checksum state, and the
	 * frame would leave with the sum unfinished; tc rewrites it knowing the state */
	FANOUT_XFWD_PASS_CHECKSUM_PARTIAL = 5,
	FANOUT_XFWD_PASS_COUNT = 6,
};

struct fanout_xfwd_passed {
	__u64 reasons[FANOUT_XFWD_PASS_COUNT];
};

/* Live backends of every nat listener at once: each listener's backends fit. */
/* Every nat listener's live, draining and gone backends (at most FANOUT_MAX_BACKENDS each). */
#define FANOUT_LIVE_ENTRIES (3 * FANOUT_MAX_LISTENERS * FANOUT_MAX_BACKENDS)

/* fanout_listener.reserved flags. */
/* The listener is two-way (replies: nat): clients keep their backend through the
 * associations map, and the backends' replies leave from the listener's address. */
#define FANOUT_LISTENER_NAT 1u
/* The listener follows NetFlow v9 / IPFIX templates (settings.flow_templates): each datagram of
 * it that carries a template or options template set is also passed to the daemon through
 * FANOUT_MAP_TEMPLATES (fanout_templates.h); the datagram itself is forwarded as any other. */
#define FANOUT_LISTENER_TEMPLATES 2u

/* The listener routes QUIC datagrams by connection ID (`quic_lb`, fanout_quic.h): a datagram
 * whose destination connection ID carries the server ID of a backend in the listener's set goes
 * to that backend (a nat listener's client is associated with it); the rest by the policy. */
#define FANOUT_LISTENER_QUIC 4u

/* The listener limits each source prefix's rate (`rate_limit`, fanout_rate.h): a client's
 * datagram above its prefix's datagram or byte rate, or from a new source above the listener's
 * new-source ceiling, is dropped and counted before anything is chosen for it. */
#define FANOUT_LISTENER_RATE 8u

/* A nat listener caps the bytes sent back to a client not yet validated (`amplification`,
 * fanout_rate.h): a reply that would take them past `factor` times what the client sent is
 * dropped and counted. */
#define FANOUT_LISTENER_AMP 16u

/* fanout_fragment.direction */
#define FANOUT_DIRECTION_FORWARD 0 /* client to backend: destination rewritten */
#define FANOUT_DIRECTION_REPLY   1 /* backend to client: source rewritten to the listener's */

#define FANOUT_OPTIONS           fanout_options
#define FANOUT_OPTIONS_NAME      "fanout_options"

/* Options fixed at load time: a read-only global (.rodata) userspace sets before loading, so
 * the verifier sees constants. */
struct fanout_tc_options {
	/* BPF_F_IPV6 where bpf_l4_csum_replace accepts it (kernel 6.15+; probed), else 0. ORed
	 * into IPv6 pseudo-header checksum updates: without it the kernel adjusts skb->csum of a
	 * CHECKSUM_COMPLETE packet as for IPv4, which is wrong when IPv6 addresses change. */
	__u64 ipv6_csum_flags;
};

enum fanout_policy {
	/* each packet to the next backend of a weighted rotation, per CPU (the reference's) */
	FANOUT_POLICY_ROUND_ROBIN = 0,
	/* every packet of one source address to one backend (Maglev table, weights) */
	FANOUT_POLICY_SOURCE_IP = 1,
	/* replication pools only (`balancing: all`): every member with a weight gets a copy */
	FANOUT_POLICY_ALL = 2,
};

/* What the program did with a packet: every packet gets exactly one. Counted per listener
 * (per CPU); the last three are counted in the FANOUT_UNMATCHED_STATS entry because no
 * listener can be known. */
enum fanout_verdict {
	/* rewritten and redirected; next-hop MACs from the fib lookup */
	FANOUT_VERDICT_FORWARDED = 0,
	/* rewritten and redirected; the kernel resolves the next hop's MAC (bpf_redirect_neigh) */
	FANOUT_VERDICT_FORWARDED_NEIGH = 1,
	/* the listener has no backend with a weight: dropped */
	FANOUT_VERDICT_NO_BACKEND = 2,
	/* the fib lookup found no route to the backend (unreachable, blackhole, prohibited,
	 * local, forwarding disabled): dropped */
	FANOUT_VERDICT_NO_ROUTE = 3,
	/* TTL or hop limit would reach 0 on forwarding: dropped, as a router would */
	FANOUT_VERDICT_TTL_EXPIRED = 4,
	/* larger than the route's MTU toward the backend (a packet that is not GSO): dropped,
	 * where the redirect would have been dropped by the egress device uncounted */
	FANOUT_VERDICT_TOO_LARGE = 5,
	/* a kernel helper refused to rewrite or redirect the packet: dropped */
	FANOUT_VERDICT_REWRITE_FAILED = 6,
	/* a later fragment whose first fragment was not seen (or forgotten): passed untouched */
	FANOUT_VERDICT_FRAGMENT_UNTRACKED = 7,
	/* an IPv4/IPv6 packet whose headers end early or are invalid: passed untouched */
	FANOUT_VERDICT_MALFORMED = 8,
	/* not a UDP datagram for a listener on this interface (other protocols, ports, addresses,
	 * interfaces): passed untouched, down the chain */
	FANOUT_VERDICT_NOT_OURS = 9,
	/* a backend's reply to its associated client (nat listeners): source rewritten to the
	 * listener's address and port, redirected toward the client */
	FANOUT_VERDICT_REPLIED = 10,
	/* a backend's datagram to a client associated with another live backend: dropped
	 * (sbulb's rule: a client talks to one backend; a client whose backend left the set
	 * moves to the replying one instead) */
	FANOUT_VERDICT_WRONG_SERVER = 11,
	/* a datagram from a backend that left a nat listener's set more than settings.drain_secs
	 * ago (FANOUT_LIVE_GONE): its clients have other backends now; dropped (reply direction) */
	FANOUT_VERDICT_DRAINED = 12,
	/* replication pools only: a copy whose next hop's Ethernet address the kernel does not know
	 * yet (a copy is cloned with the fib lookup's MACs; only the listener's own datagram can wait
	 * for the neighbour): dropped. udp-fanout keeps managed neighbour entries for the pools'
	 * next hops, so this stops once the kernel resolved them. */
	FANOUT_VERDICT_NO_NEIGHBOUR = 13,
	FANOUT_VERDICT_COUNT = 14,
};

/* Key of the listeners map: the interface the packet arrived on (the listener's configured
 * interface: one program serves every interface with a tc_ebpf listener, and a bind must not
 * match on another), destination address and port as they lie in the packet. An unspecified
 * address (all zero) matches every destination address of that family on that interface. */
struct fanout_listener_key {
	__u32 ifindex;   /* skb->ifindex at ingress */
	__u32 addr[4];   /* IPv4: addr[0], the rest 0 */
	__u16 port;      /* network order */
	__u8 family;     /* AF_INET or AF_INET6 */
	__u8 pad;
};

/* fanout_pool.flags */
/* Only datagrams from the pool's `sources` (FANOUT_MAP_POOL_SOURCES under the pool's id). */
#define FANOUT_POOL_SOURCES 1u

/* A replication pool of a listener: each datagram of the listener is also offered to it. */
struct fanout_pool {
	__u32 id;         /* its own id (< FANOUT_MAX_LISTENERS): set key / 2, rotation, counters */
	__u32 generation; /* 0 or 1, flipped with the listener's entry */
	__u32 policy;     /* enum fanout_policy: one member by rotation or source, or ALL */
	__u32 sample;     /* one source address in `sample` (0 and 1: every source) */
	__u32 flags;      /* FANOUT_POOL_SOURCES */
};

/* Value of the listeners map. The program reads the backend set at key id*2 + generation:
 * userspace writes the other generation and then flips this value, so a packet sees either
 * the old set or the new one, never a mix (its pools' sets too). */
struct fanout_listener {
	__u32 id;         /* < FANOUT_MAX_LISTENERS: stats key, and set key / 2 */
	__u32 generation; /* 0 or 1 */
	__u32 policy;     /* enum fanout_policy */
	__u32 reserved;   /* flags: FANOUT_LISTENER_NAT */
	__u32 pool_count; /* <= FANOUT_MAX_POOLS */
	struct fanout_pool pools[FANOUT_MAX_POOLS];
};

/* Key of FANOUT_MAP_POOL_SOURCES (an LPM trie): a pool's id * 2 + generation (the prefixes of
 * each generation apart, flipped with the listener's entry), then the address as IPv6 (an IPv4
 * prefix as IPv4-mapped, ::ffff:a.b.c.d). prefixlen counts the id's 32 bits too. */
struct fanout_pool_source_key {
	__u32 prefixlen;
	__u32 pool_id;    /* id * 2 + generation */
	__u8 addr[16];
};

struct fanout_backend {
	__u32 addr[4];      /* network order; IPv4: addr[0] */
	__u16 port;         /* network order */
	__u16 counter_slot; /* < FANOUT_MAX_BACKENDS: the backend stats key is id*MAX + slot */
};

/* One generation of a listener's backends. */
struct fanout_set {
	__u32 count;        /* backends in use */
	__u32 rotation_len; /* entries of rotation in use (0: no backend has a weight) */
	__u32 table_size;   /* entries of table in use (0: no table) */
	__u32 seed;         /* source hash seed */
	struct fanout_backend backends[FANOUT_MAX_BACKENDS];
	__u16 rotation[FANOUT_ROTATION_MAX]; /* backend indexes, smooth weighted round robin */
	__u16 table[FANOUT_TABLE_SIZE];      /* backend indexes, rendezvous-filled (SourceTable.swift) */
};

/* A datagram in fragments: its first fragment's choice, found again by arrival interface
 * (a listener matches only on its own), source, destination and IP identification. */
struct fanout_fragment_key {
	__u32 saddr[4];
	__u32 daddr[4];
	__u32 id;        /* IPv4: 16 bits; IPv6: the fragment header's 32 bits */
	__u32 ifindex;   /* skb->ifindex at ingress */
	__u8 family;
	__u8 pad[3];
};

/* fanout_fragment_pool.member when the pool copies to every member (FANOUT_POLICY_ALL). */
#define FANOUT_FRAGMENT_EVERY_MEMBER 0xffff

/* fanout_fragment_pool.outcome: what a pool did with a datagram. */
#define FANOUT_POOL_TAKEN       1 /* copied to its member (or every member) */
#define FANOUT_POOL_FILTERED    2 /* not from its `sources` */
#define FANOUT_POOL_SAMPLED     3 /* not one of its `sample` */
#define FANOUT_POOL_NO_MEMBER   4 /* it has no member with a weight */
#define FANOUT_POOL_TTL_EXPIRED 5 /* TTL / hop limit 1: goes nowhere */

/* What a datagram did in one replication pool: decided for a whole datagram or first fragment,
 * remembered so later fragments follow it. */
struct fanout_fragment_pool {
	__u32 id;         /* the pool's id */
	__u32 generation; /* the set the first fragment's choice was made in */
	__u16 member;     /* index in that set, or FANOUT_FRAGMENT_EVERY_MEMBER */
	__u8 outcome;     /* FANOUT_POOL_* */
	__u8 pad;
};

/* A remembered first fragment's decision. FANOUT_DIRECTION_FORWARD: `backend` is the new
 * destination; FANOUT_DIRECTION_REPLY: `backend` is the listener's address and port, the new
 * source, and counter_slot the replying backend's slot. */
struct fanout_fragment {
	struct fanout_backend backend;
	__u32 listener_id;
	__u32 direction;
	/* FANOUT_VERDICT_FORWARDED when the first fragment left for `backend`; else its verdict
	 * (the listener had no backend, say, while its pools took it): later fragments go to the
	 * pools and are dropped with that verdict */
	__u32 own_verdict;
	__u32 pool_count;
	struct fanout_fragment_pool pools[FANOUT_MAX_POOLS];
};

/* Per-CPU counters of one listener. `received`, `bytes_received` and `bytes_forwarded` count
 * the client direction; `verdicts` counts every packet of the listener in both directions (each
 * exactly once), and `reply_verdicts` the reply direction's share of them, so the client
 * direction's verdict is verdicts - reply_verdicts. */
struct fanout_stats {
	__u64 received;
	__u64 bytes_received;
	__u64 bytes_forwarded;
	__u64 verdicts[FANOUT_VERDICT_COUNT];
	/* nat listeners only */
	__u64 reply_verdicts[FANOUT_VERDICT_COUNT];
	__u64 reply_bytes;       /* bytes of replies redirected (REPLIED) */
	__u64 created;           /* associations made for a new client (its first datagram) */
	__u64 server_initiated;  /* associations made by a backend's datagram to a new client */
	__u64 moved;             /* associations whose backend was no longer live: chosen again */
	/* replication pools (at the pool's id): datagrams not taken by `sample`, by `sources` */
	__u64 sampled_out;
	__u64 filtered_out;
};

/* Per-CPU counters of one backend slot of one listener: forwarded, and dropped for this
 * backend by reason (the listener's verdicts count the same packets too). */
struct fanout_backend_stats {
	__u64 packets;
	__u64 bytes;
	__u64 no_route;  /* FANOUT_VERDICT_NO_ROUTE */
	__u64 too_large; /* FANOUT_VERDICT_TOO_LARGE */
	__u64 replies;   /* nat listeners: this backend's replies redirected to clients */
	__u64 reply_bytes;
	/* replication pools: copies to this member dropped for want of its next hop's MAC
	 * (FANOUT_VERDICT_NO_NEIGHBOUR), or refused by a helper (FANOUT_VERDICT_REWRITE_FAILED) */
	__u64 no_neighbour;
	__u64 rewrite_failed;
};

/* Key of an association (the inner maps of FANOUT_MAP_ASSOCIATIONS): a client. */
struct fanout_association_key {
	__u32 addr[4];   /* network order; IPv4: addr[0] */
	__u16 port;      /* network order */
	__u8 family;
	__u8 pad;
};

/* Value of an association: the client's backend. */
struct fanout_association {
	__u32 addr[4];
	__u16 port;
	/* the counter slot + 1 of the backend the client moved away from while that backend was
	 * draining (0: none): that backend's in-flight replies to the client still leave from the
	 * listener's address until its drain ends */
	__u16 drained_slot;
};

/* Key of FANOUT_MAP_LIVE: a backend that is a weighted member of a nat listener's current set
 * (with quic_lb any member: a weight-0 one keeps its connections), or left it (draining, gone: fanout_live.state). Userspace adds new members before flipping the
 * set generation and marks gone ones draining after. */
struct fanout_live_key {
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 pad;
};

/* fanout_live.state: a backend of the current set, one that left it and drains (no new
 * clients, its clients move on their next datagram, its replies to them still leave from the
 * listener's address), or one whose drain ended (its datagrams are dropped, FANOUT_VERDICT_DRAINED). */
#define FANOUT_LIVE_ACTIVE   0
#define FANOUT_LIVE_DRAINING 1
#define FANOUT_LIVE_GONE     2

struct fanout_live {
	__u32 listener_id;
	__u16 counter_slot;
	__u8 state;      /* FANOUT_LIVE_* */
	__u8 pad;
};

/* FANOUT_MAP_NAT, by listener id: the address replies leave from (the listener's bind). */
struct fanout_nat {
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 enabled;    /* FANOUT_NAT_ENABLED while the listener is a nat listener, with FANOUT_NAT_QUIC */
};

#define FANOUT_NAT_ENABLED 1u
/* The nat listener routes by QUIC connection ID (quic_lb): one client address and port may hold
 * connections on several backends (a QUIC client can multiplex them over one socket, and a
 * connection follows its ID, not the client's association), so a live backend's datagram to a
 * client associated with another one leaves too (fanout_nat.h: REPLY_SHARED), never counted
 * wrong_server. */
#define FANOUT_NAT_QUIC 2u

/* Each nat listener's association map is created by userspace with this name and its listener
 * id ("fanout_assoc_7"); bpf/map_count.bpf.c counts the maps with this prefix. */
#define FANOUT_ASSOCIATION_MAP_PREFIX "fanout_assoc_"

/* What bpf/map_count.bpf.c writes per association map: the map's kernel id and the number of
 * entries in it now (the kernel's own count: evictions of the LRU map included). */
struct fanout_map_count {
	__u32 id;
	__u32 pad;
	__s64 entries;
};

/* QUIC-LB (`quic_lb`, bpf/include/fanout_quic.h; draft-ietf-quic-load-balancers). Each map is
 * keyed by a listener's set key (id * 2 + generation): userspace writes the inactive generation's
 * configurations, server IDs and keys with its set, and the flip of the listener entry puts them
 * in force together. They are handed to the next process with the other maps when it has them
 * (a previous process without them had no quic_lb listener in the kernel), so FANOUT_MAPS_LAYOUT
 * stays. */
#define FANOUT_MAP_QUIC_CONFIGS      fanout_quicc
#define FANOUT_MAP_QUIC_CONFIGS_NAME "fanout_quicc"
#define FANOUT_MAP_QUIC_IDS          fanout_quicid
#define FANOUT_MAP_QUIC_IDS_NAME     "fanout_quicid"
/* The AES-128 keys: an ARRAY by set key * FANOUT_QUIC_CONFIGS + config ID of kernel crypto
 * contexts (struct bpf_crypto_ctx, ecb(aes)), made by the syscall program of
 * bpf/fanout_quic_keys.bpf.c (FANOUT_PROG_QUIC_KEYS) from struct fanout_quic_key_args. */
#define FANOUT_MAP_QUIC_KEYS         fanout_quick
#define FANOUT_MAP_QUIC_KEYS_NAME    "fanout_quick"
/* Per-CPU, by listener id: struct fanout_quic_stats (not handed over: a restart counts anew). */
#define FANOUT_MAP_QUIC_STATS        fanout_quicst
#define FANOUT_MAP_QUIC_STATS_NAME   "fanout_quicst"
#define FANOUT_PROG_QUIC_KEYS        fanout_quic_key
#define FANOUT_PROG_QUIC_KEYS_NAME   "fanout_quic_key"

/* Config IDs (the top three bits of a connection ID's first octet); 7 is never configured. */
#define FANOUT_QUIC_CONFIGS 8
/* Server IDs of every set generation of every listener at once. */
#define FANOUT_QUIC_ID_ENTRIES (FANOUT_MAX_LISTENERS * 2 * FANOUT_MAX_BACKENDS)
#define FANOUT_QUIC_KEY_ENTRIES (FANOUT_MAX_LISTENERS * 2 * FANOUT_QUIC_CONFIGS)

/* fanout_quic_config.cipher */
#define FANOUT_QUIC_PLAINTEXT   0
#define FANOUT_QUIC_SINGLE_PASS 1 /* server ID + nonce 16 octets: one AES-128 block */
#define FANOUT_QUIC_FOUR_PASS   2 /* otherwise: the four-pass Feistel network */

/* One config ID of a listener's set generation; server_id_length 0: none under this ID. */
struct fanout_quic_config {
	__u8 server_id_length; /* 1..15 */
	__u8 nonce_length;     /* 4..18, with the server ID at most 19 */
	__u8 cipher;           /* FANOUT_QUIC_* */
	__u8 pad;
};

/* Value of FANOUT_MAP_QUIC_CONFIGS, by set key. */
struct fanout_quic_configs {
	struct fanout_quic_config configs[FANOUT_QUIC_CONFIGS];
};

/* Key of FANOUT_MAP_QUIC_IDS (a hash; the value is the backend's index in that set, __u32): a
 * set key and a server ID, zero-padded. */
struct fanout_quic_id_key {
	__u32 set;
	__u8 server_id[16];
};

/* What the program made of a quic_lb listener's datagram: the metric's `outcome`. */
enum fanout_quic_outcome {
	FANOUT_QUIC_ROUTED = 0,            /* its connection ID names a backend of the set */
	FANOUT_QUIC_FALLBACK = 1,          /* a client-chosen ID (Initial, 0-RTT) naming none */
	FANOUT_QUIC_UNKNOWN_SERVER_ID = 2, /* a server-chosen ID naming no backend of the set */
	FANOUT_QUIC_UNDECODABLE = 3,       /* not readable as QUIC of a configured config ID */
	FANOUT_QUIC_OUTCOMES = 4,
	FANOUT_QUIC_ENCRYPTED = 254,       /* (in the program: the ID is read, to be decrypted) */
	FANOUT_QUIC_NONE = 255,            /* not a quic_lb listener's datagram */
};

struct fanout_quic_stats {
	__u64 outcomes[FANOUT_QUIC_OUTCOMES];
};

/* The context of FANOUT_PROG_QUIC_KEYS (BPF_PROG_TEST_RUN's ctx_in): puts an ecb(aes) context
 * of `key` into FANOUT_MAP_QUIC_KEYS at `slot`, or empties the slot (`clear`). The run's
 * return value is 0 or a negative errno (bpf_crypto_ctx_create's). */
struct fanout_quic_key_args {
	__u32 slot;
	__u32 clear;
	__u8 key[16];
};

/* Per-source limits (`rate_limit`, bpf/include/fanout_rate.h). Made by each process (not handed
 * over: a restart starts every source with a full bucket), so FANOUT_MAPS_LAYOUT stays:
 * configurations by listener id, each listener's buckets (an array of per-listener LRU hashes
 * of `max_sources` made from the inner template), its `allow` prefixes, and per-CPU counters. */
#define FANOUT_MAP_RATE_CONFIGS      fanout_ratec
#define FANOUT_MAP_RATE_CONFIGS_NAME "fanout_ratec"
#define FANOUT_MAP_RATE_BUCKETS      fanout_rateb
#define FANOUT_MAP_RATE_BUCKETS_NAME "fanout_rateb"
#define FANOUT_MAP_RATE_ALLOW        fanout_ratea
#define FANOUT_MAP_RATE_ALLOW_NAME   "fanout_ratea"
#define FANOUT_MAP_RATE_STATS        fanout_rates
#define FANOUT_MAP_RATE_STATS_NAME   "fanout_rates"
/* Each listener's bucket map is made by userspace with this name and its listener id. */
#define FANOUT_RATE_BUCKETS_PREFIX   "fanout_rateb_"
/* `allow` prefixes of every listener at once (256 each), twice: a reload's new instance writes
 * its own beside the old one's. */
#define FANOUT_RATE_ALLOW_ENTRIES    (FANOUT_MAX_LISTENERS * 256 * 2)

/* Value of FANOUT_MAP_RATE_CONFIGS (an ARRAY by listener id). Each limit is a GCRA (a token
 * bucket kept as a theoretical arrival time, TAT, in bpf_ktime_get_ns nanoseconds): a datagram
 * conforms when max(TAT, now) + its cost is at most `tolerance` past now. An interval or rate
 * of 0: that limit is off. */
struct fanout_rate_config {
	__u64 datagram_interval;    /* nanoseconds per datagram */
	__u64 datagram_tolerance;   /* the burst's worth of nanoseconds */
	__u64 bytes_per_second;     /* a datagram of n bytes costs n * 1e9 / bytes_per_second */
	__u64 byte_tolerance;
	__u64 new_source_interval;  /* nanoseconds per new source of the listener */
	__u64 new_source_tolerance;
	__u32 ipv4_mask;            /* network order: the bits of an IPv4 source its key keeps */
	__u32 ipv6_mask[4];         /* network order, per word */
	__u32 has_allow;            /* the listener has `allow` prefixes in FANOUT_MAP_RATE_ALLOW */
	__u8 pad[56];
	/* The listener's new-source TAT, written by the programs on every CPU under a flood of new
	 * sources: at offset 128 with 56 bytes of padding each side, so whatever the value's
	 * alignment (8 bytes at least) its cache line holds none of what every datagram reads
	 * above, nor the next listener's. */
	__u64 new_source_tat;
	__u8 pad2[56];
};

_Static_assert(__builtin_offsetof(struct fanout_rate_config, new_source_tat) == 128 && sizeof(struct fanout_rate_config) == 192,
	       "fanout_rate_config: new_source_tat alone on the third cache line");

/* Key of a listener's bucket map: the source masked to its prefix (IPv4 as ::ffff:a.b.c.d). */
struct fanout_rate_key {
	__u32 addr[4];
};

/* Value of a listener's bucket map. */
struct fanout_rate_bucket {
	__u64 datagram_tat;
	__u64 byte_tat;
	__u64 limited;              /* datagrams of this source dropped (for /status's top sources) */
};

/* Key of FANOUT_MAP_RATE_ALLOW (an LPM trie): prefixlen counts the listener id's 32 bits and
 * the address's (IPv4 as ::ffff:a.b.c.d, so 96 + its length). */
struct fanout_rate_allow_key {
	__u32 prefixlen;
	__u32 listener;
	__u8 addr[16];
};

/* Per CPU, by listener id. */
struct fanout_rate_stats {
	__u64 limited;              /* datagrams dropped: above their source's rates */
	__u64 limited_bytes;
	__u64 new_sources_refused;  /* datagrams dropped: a new source above the ceiling */
	__u64 amplification_capped; /* replies dropped: a client not yet validated (amplification) */
	__u64 amplification_capped_bytes;
};

/* The amplification cap of nat listeners (`amplification`, fanout_rate.h), made by each process
 * as rate_limit's maps are: configurations by listener id, and each listener's clients (an
 * array of per-listener LRU hashes of settings.max_associations made from the inner template).
 * A client the maps do not know (one associated before this process, or by its server) is not
 * capped. */
#define FANOUT_MAP_AMP_CONFIGS       fanout_ampc
#define FANOUT_MAP_AMP_CONFIGS_NAME  "fanout_ampc"
#define FANOUT_MAP_AMP_CLIENTS       fanout_ampb
#define FANOUT_MAP_AMP_CLIENTS_NAME  "fanout_ampb"
#define FANOUT_AMP_CLIENTS_PREFIX    "fanout_ampb_"

/* Value of FANOUT_MAP_AMP_CONFIGS (an ARRAY by listener id); factor 0: no cap. */
struct fanout_amp_config {
	__u32 factor;
	__u32 validated_after;      /* exchanges that validate a client; 0: none does */
};

/* Key of a listener's client map: the client's address and port (network order). */
struct fanout_amp_key {
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 pad;
};

/* Value of a listener's client map. */
struct fanout_amp_client {
	__u64 bytes_in;             /* UDP payload bytes forwarded from the client */
	__u64 bytes_out;            /* UDP payload bytes sent back to it */
	__u32 exchanges;            /* its datagrams that came after a reply was sent to it */
	__u8 replied;               /* a reply was sent since its last datagram */
	__u8 validated;
	__u16 pad;
};

/* Capture of what a listener drops (`udp-fanout capture`, bpf/include/fanout_capture.h). Made by
 * each process (not handed over): a ring buffer of dropped packets, each capture's filter and
 * sampling by listener id, and per-CPU counters. Empty while no capture runs. */
#define FANOUT_MAP_CAPTURE               fanout_cap
#define FANOUT_MAP_CAPTURE_NAME          "fanout_cap"
#define FANOUT_MAP_CAPTURE_CONFIGS       fanout_capc
#define FANOUT_MAP_CAPTURE_CONFIGS_NAME  "fanout_capc"
#define FANOUT_MAP_CAPTURE_STATS         fanout_caps
#define FANOUT_MAP_CAPTURE_STATS_NAME    "fanout_caps"
#define FANOUT_CAPTURE_RING_BYTES (1 << 20)
/* The most of a packet kept (from its IP header): a 1500-byte MTU's whole packet. */
#define FANOUT_CAPTURE_DATA_MAX 2048

/* A capture's reasons beyond the verdicts (enum fanout_verdict): a client's datagram above its
 * source's rates (rate_limit), a reply past its client's cap (amplification). */
#define FANOUT_CAPTURE_RATE_LIMITED (FANOUT_VERDICT_COUNT + 0)
#define FANOUT_CAPTURE_AMP_CAPPED   (FANOUT_VERDICT_COUNT + 1)

/* Value of FANOUT_MAP_CAPTURE_CONFIGS (an ARRAY by listener id); snaplen 0: no capture. The
 * sampling is a GCRA as rate_limit's (at most one packet per `interval`, `tolerance` of burst)
 * for the listener, whatever its sources. */
struct fanout_capture_config {
	__u64 forward_reasons;      /* bit (1 << reason) per reason captured, client datagrams */
	__u64 reply_reasons;        /* the same for replies */
	__u64 interval;
	__u64 tolerance;
	__u64 tat;
	__u32 snaplen;              /* bytes kept from the IP header, at most FANOUT_CAPTURE_DATA_MAX */
	__u32 reserved;
};

/* One dropped packet in FANOUT_MAP_CAPTURE (only `length` bytes of `data` are in the ring). */
struct fanout_capture_event {
	__u64 time;                 /* bpf_ktime_get_ns */
	__u32 listener_id;
	__u32 wire_length;          /* the packet's length from its IP header */
	__u32 length;               /* of data */
	__u16 reason;               /* enum fanout_verdict, or FANOUT_CAPTURE_* */
	__u8 flags;                 /* FANOUT_CAPTURE_FLAG_* */
	__u8 family;
	__u8 data[FANOUT_CAPTURE_DATA_MAX];
};

/* fanout_capture_event.flags: a reply of a nat listener (not a client's datagram); the packet
 * was rewritten for a replication pool's copy before it was dropped (tc: the copies leave
 * first, from the packet itself). */
#define FANOUT_CAPTURE_FLAG_REPLY     1
#define FANOUT_CAPTURE_FLAG_REWRITTEN 2

/* Per CPU, by listener id. */
struct fanout_capture_stats {
	__u64 captured;
	__u64 sampled_out;          /* above the capture's sampling rate */
	__u64 ring_full;            /* the daemon had not read the ring fast enough */
	__u64 unreadable;           /* taken, but its bytes could not be read */
};

#endif /* FANOUT_SHARED_H */
