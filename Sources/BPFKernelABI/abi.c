// SPDX-License-Identifier: Apache-2.0
/* SwiftPM needs a source file in a C target; the ABI lives in include/BPFKernelABI.h. */
#include "BPFKernelABI.h"
