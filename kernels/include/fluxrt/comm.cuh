// The fluxrt device library, for kernels that touch peers:
//   fluxrt/types.cuh    element types (bf16, fp16, fp32, bytes), 16-bit float conversions, kMaxWorld
//   fluxrt/sync.cuh     signal / wait: the memory-ordering contract, bounded waits, ErrorRecord
//   fluxrt/copy.cuh     vectorised block and grid copies, ranges split over blocks
//   fluxrt/reduce.cuh   deterministic fixed-order fp32 reduction of partials
#pragma once

#include "fluxrt/types.cuh"
#include "fluxrt/sync.cuh"
#include "fluxrt/copy.cuh"
#include "fluxrt/reduce.cuh"
