// CUDA side of the staging ring, declared without CUDA types (streams are passed as void*, i.e. cudaStream_t) so
// the torch binding compiles without CUDA headers and staging_ring_cuda.cu compiles without torch headers.
#pragma once

#include <cstdint>

#include "staging_ring.h"

namespace pipemorph {
namespace staging {
namespace cuda {

// Page-locks [base, base + bytes) (the whole ring mapping) for DMA with cudaHostRegisterPortable.
void register_host(void* base, uint64_t bytes, const std::string& ring_name);
// Waits for all device work (callbacks may still point into the mapping), then cudaHostUnregister. Never throws.
void unregister_host(void* base) noexcept;

// Send path (Fig. 11): enqueue the D2H copy of nbytes from device memory src into the claimed slot, then, in the
// SAME stream, a host function that release-stores FULL into the slot. Returns at once: the caller never waits
// for the copy. The slot's metadata must be filled before the call.
void enqueue_send(Ring& ring, const Slot& slot, const void* src, uint64_t nbytes, void* stream);

// Receive path (Fig. 12): enqueue the H2D copy of the (FULL, claimed) slot into device memory dst, then, in the
// SAME stream, a host function that release-stores EMPTY so the producer can reuse the slot. Work the caller
// enqueues afterwards on that stream sees the data (stream order); other streams must wait on an event.
void enqueue_recv(Ring& ring, const Slot& slot, void* dst, uint64_t nbytes, void* stream);

}  // namespace cuda
}  // namespace staging
}  // namespace pipemorph
