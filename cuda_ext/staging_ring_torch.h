// Tensor <-> slot helpers shared by the CPU binding (staging_ring_cpu.cpp, which defines them) and the CUDA
// binding (staging_ring_cuda_bind.cpp). Needs torch; not included by the .cu file.
#pragma once

#include <torch/extension.h>

#include <optional>

#include "staging_ring.h"

namespace pipemorph {
namespace staging {

// Lets Ctrl-C (any pending Python signal) interrupt a long wait; the ring calls it about every 100 ms.
extern const PollFn kCheckSignals;

// None (no timeout) -> -1 (wait forever); negative values -> 0.
double timeout_or_forever(const std::optional<double>& timeout_s);

// Writes tag, dtype (c10::ScalarType code), ndim and shape of t into a claimed slot.
void fill_meta(const Slot& s, const at::Tensor& t, int64_t tag);

// The tensor that receives the message in slot s: a new one on dev, or `out` after checking dtype, element
// count, device and contiguity (throws std::invalid_argument before anything is claimed, so the message stays).
at::Tensor destination(const Ring& ring, const Slot& s, const std::optional<at::Tensor>& out, const at::Device& dev);

}  // namespace staging
}  // namespace pipemorph
