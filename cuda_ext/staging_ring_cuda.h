// CUDA side of the staging ring, declared without CUDA types (streams are passed as void*, i.e. cudaStream_t) so
// the torch binding compiles without CUDA headers and staging_ring_cuda.cu compiles without torch headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "staging_ring.h"

namespace pipemorph {
namespace staging {
namespace cuda {

// One copy between a claimed slot and device memory: bytes [slot_offset, slot_offset + nbytes) of the slot's
// payload and nbytes at device address `device` (source of a send, destination of a receive). A message piece
// made of several tensors is several spans into one slot.
struct Span {
  uint64_t slot_offset;
  uint64_t device;
  uint64_t nbytes;
};

// Page-locks [base, base + bytes) (the whole ring mapping) for DMA with cudaHostRegisterPortable.
void register_host(void* base, uint64_t bytes, const std::string& ring_name);
// Waits for all device work (callbacks may still point into the mapping), then cudaHostUnregister. Never throws.
void unregister_host(void* base) noexcept;

// Send path (Fig. 11): enqueue the D2H copy of every span into the claimed (WRITING) slot, then, in the SAME
// stream, a host function that release-stores FULL into the slot (publishes it to the delegate). Returns at
// once: the caller never waits for the copies. The slot's metadata and any bytes the caller wrote into the slot
// itself must be written before the call. If a copy cannot be started, waits for the ones already queued, gives
// the slot back unpublished (abort_write) and throws.
void enqueue_send(Ring& ring, const Slot& slot, const Span* spans, size_t n, void* stream);

// Receive path (Fig. 12): enqueue the H2D copy of every span out of the claimed (READING) slot, then, in the SAME
// stream, a host function that release-stores EMPTY so the producer can reuse the slot only once the copies have
// read it. Work enqueued afterwards on that stream sees the data (stream order); other streams wait on an event.
// If a copy cannot be started, waits for the ones already queued, puts the message back (abort_read) and throws.
void enqueue_recv(Ring& ring, const Slot& slot, const Span* spans, size_t n, void* stream);

}  // namespace cuda
}  // namespace staging
}  // namespace pipemorph
