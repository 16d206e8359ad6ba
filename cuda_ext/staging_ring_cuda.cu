// CUDA side of the staging ring (PipeMorph §5.2, Fig. 11/12). Depends only on the CUDA runtime and
// staging_ring.h, so `nvcc -c staging_ring_cuda.cu -I cuda_ext` compiles it without torch.
//
// Ordering after the producer: the caller makes the copy stream wait on an event recorded on the compute stream
// after the kernel that produced the tensor (a send) or before the consumer uses it (a receive: the consumer
// stream waits on an event recorded here after the copies); this file only enqueues on the copy stream.
//
// Completion flag: cudaLaunchHostFunc after the copies, in the same stream. The host function runs on a driver
// thread only after every earlier operation of the stream has completed, including the DMA into/out of the
// pinned slot, and then does a C++ release store of the slot state (plus a FUTEX_WAKE if the peer sleeps on it:
// a syscall, not a CUDA call, so allowed in a host function). The peer's acquire load of that state
// therefore orders the payload (send) or the end of our read (receive) before its own accesses: the guarantee
// comes from the CUDA stream semantics plus the C++ memory model, with no assumption about PCIe write
// ordering (a second cudaMemcpyAsync of a flag word relies on that) and no driver-API stream memory operations
// (cuStreamWriteValue32 needs CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS and a device alias of the flag). The
// cost is one driver callback per slot (tens of microseconds), small next to an MB-sized copy, and the
// enqueueing thread never blocks on the copy. Because the flag flips only in the callback, the delegate cannot
// reuse a slot before the D2H copy into it completed, nor can the producer overwrite one before our H2D copy
// out of it completed.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "staging_ring_cuda.h"

namespace pipemorph {
namespace staging {
namespace cuda {

namespace {

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// Host functions must not call CUDA. Each is one atomic store + maybe a futex wake (staging_ring.h: ordering).
// The slot metadata was written by the enqueuing thread before cudaLaunchHostFunc; the driver hands the
// callback to its thread through its own synchronisation, so those writes happen before this release store.
void CUDART_CB publish_slot(void* slot) { Ring::publish(static_cast<SlotHeader*>(slot)); }
void CUDART_CB release_slot(void* slot) { Ring::release(static_cast<SlotHeader*>(slot)); }

std::string slot_text(const Ring& ring, const Slot& slot) {
  return "staging ring '" + ring.name() + "' slot " + std::to_string(slot.index) + " (message " +
         std::to_string(slot.seq) + ")";
}

// Enqueues the copy of every span (D2H when to_host, else H2D), then the host function `done` on the slot.
// On a failure to enqueue a copy: waits for the copies already queued (they touch the slot), runs `undo` (the
// slot goes back to the state the claim found it in) and throws. If only the host function cannot be queued,
// waits for the copies and runs `mark` (what `done` would have done) from this thread instead.
void enqueue(Ring& ring, const Slot& slot, const Span* spans, size_t n, cudaStream_t s, bool to_host,
             cudaHostFn_t done, void (Ring::*undo)(const Slot&), void (*mark)(SlotHeader*), const char* what) {
  char* payload = static_cast<char*>(slot.payload);
  for (size_t i = 0; i < n; ++i) {
    if (spans[i].nbytes == 0) continue;
    void* host = payload + spans[i].slot_offset;
    void* dev = reinterpret_cast<void*>(static_cast<uintptr_t>(spans[i].device));
    cudaError_t err = to_host ? cudaMemcpyAsync(host, dev, spans[i].nbytes, cudaMemcpyDeviceToHost, s)
                              : cudaMemcpyAsync(dev, host, spans[i].nbytes, cudaMemcpyHostToDevice, s);
    if (err != cudaSuccess) {
      cudaStreamSynchronize(s);
      (ring.*undo)(slot);
      check(err, std::string("cannot start the ") + what + " " + slot_text(ring, slot));
    }
  }
  cudaError_t err = cudaLaunchHostFunc(s, done, slot.header);
  if (err != cudaSuccess) {
    check(cudaStreamSynchronize(s), std::string(what) + " " + slot_text(ring, slot) + " failed");
    mark(slot.header);
  }
}

}  // namespace

void register_host(void* base, uint64_t bytes, const std::string& ring_name) {
  check(cudaHostRegister(base, bytes, cudaHostRegisterPortable),
        "cannot pin staging ring '" + ring_name + "' (" + std::to_string(bytes) + " bytes) with cudaHostRegister");
}

void unregister_host(void* base) noexcept {
  // Callbacks of in-flight copies hold pointers into the mapping: let them run before it goes away.
  cudaDeviceSynchronize();
  cudaHostUnregister(base);
}

void enqueue_send(Ring& ring, const Slot& slot, const Span* spans, size_t n, void* stream) {
  enqueue(ring, slot, spans, n, static_cast<cudaStream_t>(stream), true, publish_slot, &Ring::abort_write,
          &Ring::publish, "device-to-host copy into");
}

void enqueue_recv(Ring& ring, const Slot& slot, const Span* spans, size_t n, void* stream) {
  enqueue(ring, slot, spans, n, static_cast<cudaStream_t>(stream), false, release_slot, &Ring::abort_read,
          &Ring::release, "host-to-device copy out of");
}

}  // namespace cuda
}  // namespace staging
}  // namespace pipemorph
