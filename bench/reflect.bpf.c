// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * A packet reflector for the two-way benchmarks' load-generator phase (make bench only, never
 * embedded). Attached at tc ingress of an endpoint's veth (a client's or a real server's), it
 * answers every IPv4 UDP datagram at once by sending it back out of the same veth with the
 * Ethernet, IP and UDP source and destination swapped (reflect.h): at a real server that is an
 * echo reply, at a client it is the client's next request. A fixed number of datagrams then
 * circulate through the load balancer, each lap a round trip, at a cost to the endpoints of a
 * few hundred nanoseconds, so the load balancer (on a CPU of its own) is what bounds the rate,
 * as with a hardware packet generator.
 *
 * reflect_xdp does the same at the XDP hook: the datagram goes back as an XDP frame, so
 * the load balancer's veth receives frames, as from a NIC's receive ring, not socket buffers
 * (the frame-sourced two-way run of scripts/bench_frames.py).
 *
 * Built with -DSTAMP (the scale benchmark's servers), the reply also carries the server's own
 * address in its first 4 payload bytes, so that the clients' side (rotate.bpf.c) can tell which
 * server answered each client; the UDP checksum is updated for it.
 */
#include <linux/pkt_cls.h>
#include "reflect.h"

SEC("tc")
int reflect(struct __sk_buff *skb)
{
	struct reflect_frame frame;
	if (!reflect_parse(skb, &frame))
		return TC_ACT_OK;
#ifdef STAMP
	__be32 *stamp = (void *)(frame.udp + 1);
	if ((void *)(stamp + 1) > (void *)(long)skb->data_end)
		return TC_ACT_OK;
	__be32 old = *stamp, server = frame.ip->daddr; /* this server: the request's destination */
	reflect_swap(&frame);
	*stamp = server;
	/* a UDP checksum of 0 (none) stays 0; an offloaded one covers the payload later */
	bpf_l4_csum_replace(skb, REFLECT_UDP_CHECK, old, server, BPF_F_MARK_MANGLED_0 | sizeof(server));
#else
	reflect_swap(&frame);
#endif
	return bpf_redirect(skb->ifindex, 0);
}

#ifndef STAMP
SEC("xdp")
int reflect_xdp(struct xdp_md *ctx)
{
	struct reflect_frame frame;
	if (!reflect_parse_data((void *)(long)ctx->data, (void *)(long)ctx->data_end, &frame))
		return XDP_PASS;
	reflect_swap(&frame);
	/* A redirect to the arrival veth rather than XDP_TX: a veth's XDP_TX wakes its peer only if
	 * the peer runs XDP itself, a redirect (ndo_xdp_xmit) whenever the peer takes frames (an XDP
	 * program or GRO), as the tc and nftables variants' veths do. */
	return bpf_redirect(ctx->ingress_ifindex, 0);
}
#endif

char LICENSE[] SEC("license") = "Dual BSD/GPL";
