// CUDA side of the staging ring (PipeMorph §5.2, Fig. 11/12). Depends only on the CUDA runtime and
// staging_ring.h, so `nvcc -c staging_ring_cuda.cu -I cuda_ext` compiles it without torch.
//
// Completion flag: cudaLaunchHostFunc after the copy, in the same stream. The host function runs on a driver
// thread only after every earlier operation of the stream has completed, including the DMA into/out of the
// pinned slot, and then does a C++ release store of the slot state (plus a FUTEX_WAKE if the peer sleeps on it:
// a syscall, not a CUDA call, so allowed in a host function). The peer's acquire load of that state
// therefore orders the payload (send) or the end of our read (receive) before its own accesses: the guarantee
// comes from the CUDA stream semantics plus the C++ memory model, with no assumption about PCIe write
// ordering (a second cudaMemcpyAsync of a flag word relies on that) and no driver-API stream memory operations
// (cuStreamWriteValue32 needs CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS and a device alias of the flag). The
// cost is one driver callback per message (tens of microseconds), small next to an MB-sized copy, and the
// enqueueing thread never blocks on the copy.
#include <cuda_runtime.h>

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

void enqueue_send(Ring& ring, const Slot& slot, const void* src, uint64_t nbytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (nbytes > 0) {
    cudaError_t err = cudaMemcpyAsync(slot.payload, src, nbytes, cudaMemcpyDeviceToHost, s);
    if (err != cudaSuccess) {
      ring.abort_write(slot);  // nothing was enqueued: give the slot back
      check(err, "cannot start the device-to-host copy into " + slot_text(ring, slot));
    }
  }
  cudaError_t err = cudaLaunchHostFunc(s, publish_slot, slot.header);
  if (err != cudaSuccess) {
    // The copy is already queued: wait for it and publish from here, so the message is neither lost nor torn.
    cudaError_t sync = cudaStreamSynchronize(s);
    check(sync, "device-to-host copy into " + slot_text(ring, slot) + " failed");
    Ring::publish(slot.header);
  }
}

void enqueue_recv(Ring& ring, const Slot& slot, void* dst, uint64_t nbytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (nbytes > 0) {
    cudaError_t err = cudaMemcpyAsync(dst, slot.payload, nbytes, cudaMemcpyHostToDevice, s);
    if (err != cudaSuccess) {
      ring.abort_read(slot);  // nothing was read: the message stays in the ring
      check(err, "cannot start the host-to-device copy out of " + slot_text(ring, slot));
    }
  }
  cudaError_t err = cudaLaunchHostFunc(s, release_slot, slot.header);
  if (err != cudaSuccess) {
    // Release only once the copy has finished reading the slot.
    cudaError_t sync = cudaStreamSynchronize(s);
    check(sync, "host-to-device copy out of " + slot_text(ring, slot) + " failed");
    Ring::release(slot.header);
  }
}

}  // namespace cuda
}  // namespace staging
}  // namespace pipemorph
