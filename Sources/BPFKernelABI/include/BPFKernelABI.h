// SPDX-License-Identifier: Apache-2.0
/*
 * The kernel/user ABI of the BPF programs: every struct, enum, constant and map or program name
 * that crosses between bpf/*.bpf.c and Swift, from the headers the programs include themselves
 * (bpf/include), so both sides compile against one definition.
 */
#ifndef BPFKERNELABI_H
#define BPFKERNELABI_H

#include "../../../bpf/include/rplb_shared.h"
#include "../../../bpf/include/fanout_shared.h"
#include "../../../bpf/include/fanout_hops_shared.h"
#include "../../../bpf/include/afxdp_shared.h"

#endif
