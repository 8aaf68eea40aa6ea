// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * bpf/tc_fanout.bpf.c without the BPF crypto kfuncs (FANOUT_NO_QUIC_CRYPTO, fanout_quic.h): for
 * kernels before 6.10, where the quic_lb key map's kptr type does not exist and the map could not
 * be made (and where the full program does not load). quic_lb routes plaintext server IDs
 * only; userspace refuses a key there. Its UDP checksum updates go through bpf_l4_csum_replace
 * (FANOUT_HELPER_CSUM, fanout_redirect.h): no kfunc, no CO-RE read of the kernel's sk_buff.
 */
#define FANOUT_NO_QUIC_CRYPTO 1
#define FANOUT_HELPER_CSUM 1
#include "tc_fanout.bpf.c"
