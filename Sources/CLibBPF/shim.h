// SPDX-License-Identifier: Apache-2.0
#ifndef CLIBBPF_SHIM_H
#define CLIBBPF_SHIM_H
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <bpf/btf.h>
#endif
