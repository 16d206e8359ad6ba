// Python binding of the staging ring for CPU tensors: push/pop copy with memcpy, the GIL released while waiting
// and copying. Built by ds_pipemorph.staging.builder; the CUDA variant adds push_cuda/pop_cuda (bind_cuda).
#include "staging_ring_torch.h"

#include <algorithm>
#include <cstring>
#include <sstream>

namespace py = pybind11;
using pipemorph::staging::kMaxDims;
using pipemorph::staging::Ring;
using pipemorph::staging::Slot;

#ifdef PIPEMORPH_STAGING_WITH_CUDA
void bind_cuda(py::class_<Ring>& cls);  // staging_ring_cuda_bind.cpp
#endif

namespace pipemorph {
namespace staging {

const PollFn kCheckSignals = [] {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
};

double timeout_or_forever(const std::optional<double>& timeout_s) {
  return timeout_s.has_value() ? std::max(0.0, *timeout_s) : -1.0;
}

}  // namespace staging
}  // namespace pipemorph

namespace {

using pipemorph::staging::kCheckSignals;
using pipemorph::staging::timeout_or_forever;

std::string describe(at::ScalarType dtype, c10::IntArrayRef shape) {
  std::ostringstream o;
  o << c10::toString(dtype) << shape;
  return o.str();
}

void check_pushable(const Ring& ring, const at::Tensor& t) {
  if (!t.device().is_cpu()) {
    throw std::invalid_argument("staging ring '" + ring.name() + "': push() takes a CPU tensor, got one on " +
                                t.device().str() + " (use push_cuda from the CUDA build)");
  }
  if (t.layout() != at::kStrided) throw std::invalid_argument("staging ring '" + ring.name() + "': only dense tensors can be pushed");
  if (!t.is_contiguous()) {
    throw std::invalid_argument("staging ring '" + ring.name() + "': push() takes a contiguous tensor (call .contiguous())");
  }
  if (t.dim() > kMaxDims) {
    throw std::invalid_argument("staging ring '" + ring.name() + "': a tensor with " + std::to_string(t.dim()) +
                                " dimensions cannot be pushed (at most " + std::to_string(kMaxDims) + ")");
  }
}

// dtype and shape of the message in a slot the consumer waits on (validated: another build may have pushed it).
std::pair<at::ScalarType, std::vector<int64_t>> read_meta(const Ring& ring, const Slot& s) {
  const int32_t code = s.meta->dtype;
  if (code < 0 || code >= static_cast<int32_t>(at::ScalarType::NumOptions) || s.meta->ndim < 0 ||
      s.meta->ndim > kMaxDims) {
    throw std::runtime_error("staging ring '" + ring.name() + "': message " + std::to_string(s.seq) +
                             " has unreadable metadata (dtype code " + std::to_string(code) + ", ndim " +
                             std::to_string(s.meta->ndim) + "); was it pushed by another torch build?");
  }
  std::vector<int64_t> shape(s.meta->shape, s.meta->shape + s.meta->ndim);
  const auto dtype = static_cast<at::ScalarType>(code);
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  if (numel * c10::elementSize(dtype) != s.meta->nbytes || s.meta->nbytes > ring.slot_capacity()) {
    throw std::runtime_error("staging ring '" + ring.name() + "': message " + std::to_string(s.seq) + " says " +
                             describe(dtype, shape) + " but carries " + std::to_string(s.meta->nbytes) + " bytes");
  }
  return {dtype, shape};
}

}  // namespace

void pipemorph::staging::fill_meta(const Slot& s, const at::Tensor& t, int64_t tag) {
  s.meta->tag = tag;
  s.meta->dtype = static_cast<int32_t>(t.scalar_type());
  s.meta->ndim = static_cast<int32_t>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) s.meta->shape[d] = t.size(d);
}

at::Tensor pipemorph::staging::destination(const Ring& ring, const Slot& s, const std::optional<at::Tensor>& out,
                                          const at::Device& dev) {
  auto [dtype, shape] = read_meta(ring, s);
  if (!out.has_value()) return at::empty(shape, at::TensorOptions().dtype(dtype).device(dev));
  const at::Tensor& o = *out;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (o.device() != dev || o.scalar_type() != dtype || o.numel() != numel || !o.is_contiguous()) {
    throw std::invalid_argument("staging ring '" + ring.name() + "': out tensor " + describe(o.scalar_type(), o.sizes()) +
                                " on " + o.device().str() + " cannot receive message " + std::to_string(s.seq) + " (" +
                                describe(dtype, shape) + " for " + dev.str() +
                                ", contiguous); the message stays in the ring");
  }
  return o.sizes() == c10::IntArrayRef(shape) ? o : o.view(shape);
}

namespace {

using pipemorph::staging::destination;
using pipemorph::staging::fill_meta;

void push(Ring& ring, const at::Tensor& t, int64_t tag, const std::optional<double>& timeout_s) {
  check_pushable(ring, t);
  const uint64_t nbytes = t.numel() * t.element_size();
  py::gil_scoped_release nogil;
  Slot s = ring.claim_write(nbytes, timeout_or_forever(timeout_s), kCheckSignals);
  fill_meta(s, t, tag);
  if (nbytes > 0) std::memcpy(s.payload, t.data_ptr(), nbytes);
  Ring::publish(s.header);  // release: payload + meta above are visible to the consumer's acquire of FULL
}

std::optional<std::pair<at::Tensor, int64_t>> pop_impl(Ring& ring, double timeout_s, bool throw_on_timeout,
                                                       const std::optional<at::Tensor>& out) {
  py::gil_scoped_release nogil;
  Slot s;
  if (!ring.wait_readable(timeout_s, kCheckSignals, throw_on_timeout, &s)) return std::nullopt;
  // The acquire load of FULL in wait_readable makes meta and payload visible here.
  at::Tensor dst = destination(ring, s, out, at::Device(at::kCPU));
  ring.claim_read(s);
  if (s.meta->nbytes > 0) std::memcpy(dst.data_ptr(), s.payload, s.meta->nbytes);
  const int64_t tag = s.meta->tag;
  Ring::release(s.header);  // release: our reads of the payload and meta happen before the producer reuses it
  return std::make_pair(dst, tag);
}

// Zero-copy producer end: claims the next slot for a message of dtype/shape and returns a tensor over the slot
// itself (valid until end_write/abort_write) and the message number.
std::pair<at::Tensor, uint64_t> begin_write(Ring& ring, at::ScalarType dtype, std::vector<int64_t> shape, int64_t tag,
                                            const std::optional<double>& timeout_s) {
  if (static_cast<int64_t>(shape.size()) > kMaxDims) {
    throw std::invalid_argument("staging ring '" + ring.name() + "': at most " + std::to_string(kMaxDims) + " dimensions");
  }
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("staging ring '" + ring.name() + "': negative dimension in shape");
    numel *= static_cast<uint64_t>(d);
  }
  const uint64_t nbytes = numel * c10::elementSize(dtype);
  Slot s;
  {
    py::gil_scoped_release nogil;
    s = ring.claim_write(nbytes, timeout_or_forever(timeout_s), kCheckSignals);
  }
  at::Tensor view = at::from_blob(s.payload, shape, at::TensorOptions().dtype(dtype));
  fill_meta(s, view, tag);
  return {view, s.seq};
}

// Zero-copy consumer end: waits for the next message, claims it and returns a tensor over the slot itself
// (valid until end_read/abort_read), its tag and its message number.
std::tuple<at::Tensor, int64_t, uint64_t> begin_read(Ring& ring, const std::optional<double>& timeout_s) {
  Slot s;
  {
    py::gil_scoped_release nogil;
    ring.wait_readable(timeout_or_forever(timeout_s), kCheckSignals, true, &s);
  }
  auto [dtype, shape] = read_meta(ring, s);
  ring.claim_read(s);
  at::Tensor view = at::from_blob(s.payload, shape, at::TensorOptions().dtype(dtype));
  return {view, s.meta->tag, s.seq};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "PipeMorph host-staging ring: a shared-memory slot ring between two processes";
  py::register_exception<pipemorph::staging::TimeoutError>(m, "StagingTimeoutError", PyExc_TimeoutError);
  py::register_exception<pipemorph::staging::NoRoomError>(m, "StagingNoRoomError", PyExc_RuntimeError);
  m.attr("MAX_DIMS") = kMaxDims;
#ifdef PIPEMORPH_STAGING_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("unlink", &Ring::unlink_name, py::arg("name"),
        "Remove a ring's name; returns False if it did not exist. Open mappings stay valid.");

  py::class_<Ring> cls(m, "Ring");
  cls.def_static("create", &Ring::create, py::arg("name"), py::arg("num_slots"), py::arg("slot_bytes"),
                 py::return_value_policy::take_ownership, "Create a new ring (fails if the name exists).")
      .def_static("attach", &Ring::attach, py::arg("name"), py::arg("timeout_s") = 0.0,
                  py::return_value_policy::take_ownership, py::call_guard<py::gil_scoped_release>(),
                  "Attach to a ring created by another process, waiting up to timeout_s for it to appear.")
      .def("close", &Ring::close, "Unmap the ring (does not unlink it).")
      .def_property_readonly("closed", &Ring::closed)
      .def_property_readonly("name", &Ring::name)
      .def_property_readonly("num_slots", &Ring::num_slots)
      .def_property_readonly("slot_bytes", &Ring::slot_capacity)
      .def_property_readonly("head", &Ring::head)
      .def_property_readonly("tail", &Ring::tail)
      .def("occupancy", &Ring::occupancy, "Messages pushed (or being pushed) and not yet popped.")
      .def("push", &push, py::arg("tensor"), py::arg("tag") = 0, py::arg("timeout_s") = py::none(),
           "Copy a contiguous CPU tensor into the next free slot; waits up to timeout_s (None = forever).")
      .def(
          "pop",
          [](Ring& ring, const std::optional<double>& timeout_s, const std::optional<at::Tensor>& out) {
            return *pop_impl(ring, timeout_or_forever(timeout_s), true, out);
          },
          py::arg("timeout_s") = py::none(), py::arg("out") = py::none(),
          "Wait for the next message and return (tensor, tag); copies into `out` when given.")
      .def(
          "try_pop",
          [](Ring& ring, const std::optional<at::Tensor>& out) { return pop_impl(ring, 0.0, false, out); },
          py::arg("out") = py::none(), "Return (tensor, tag) if a message is ready, else None.")
      .def("begin_write", &begin_write, py::arg("dtype"), py::arg("shape"), py::arg("tag") = 0,
           py::arg("timeout_s") = py::none(),
           "Claim the next slot; returns (tensor over the slot, seq). Fill it, then end_write(seq).")
      .def("end_write", [](Ring& r, uint64_t seq) { Ring::publish(r.claimed(seq, pipemorph::staging::WRITING).header); },
           py::arg("seq"), "Publish a message started with begin_write (release store of FULL).")
      .def("abort_write", [](Ring& r, uint64_t seq) { r.abort_write(r.claimed(seq, pipemorph::staging::WRITING)); },
           py::arg("seq"), "Give back the slot of the last begin_write without publishing it.")
      .def("begin_read", &begin_read, py::arg("timeout_s") = py::none(),
           "Wait for and claim the next message; returns (tensor over the slot, tag, seq). Then end_read(seq).")
      .def("end_read", [](Ring& r, uint64_t seq) { Ring::release(r.claimed(seq, pipemorph::staging::READING).header); },
           py::arg("seq"), "Hand a slot from begin_read back to the producer (release store of EMPTY).")
      .def("abort_read", [](Ring& r, uint64_t seq) { r.abort_read(r.claimed(seq, pipemorph::staging::READING)); },
           py::arg("seq"), "Put the message of the last begin_read back (it will be read again).");
#ifdef PIPEMORPH_STAGING_WITH_CUDA
  bind_cuda(cls);
#endif
}
