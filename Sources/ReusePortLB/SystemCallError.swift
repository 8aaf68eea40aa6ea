// SPDX-License-Identifier: Apache-2.0
import SystemCalls

/// The error of a failed system or libbpf call (defined in SystemCalls, shared with udp-fanout):
/// kept under this name, which ReusePortLB's API has always used.
public typealias SystemCallError = SystemCalls.SystemCallError
