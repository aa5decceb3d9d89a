#include "tessel/optim/adamw.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "tessel/core/error.hpp"

namespace tessel::optim {

namespace {
// Below this many elements a parallel region costs more than the loop.
constexpr int64_t kParallelMin = int64_t(1) << 15;
}  // namespace

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWHyper& h,
                  int64_t step) {
  TESSEL_CHECK(step >= 1, "adamw step counts from 1, got ", step);
  // Step-dependent factors in double, once; the loop is pure f32 arithmetic.
  const float decay = float(1.0 - h.lr * h.weight_decay);
  const float b1 = float(h.beta1), c1 = float(1.0 - h.beta1);
  const float b2 = float(h.beta2), c2 = float(1.0 - h.beta2);
  const float step_size = float(h.lr / (1.0 - std::pow(h.beta1, double(step))));
  const float inv_sqrt_bc2 = float(1.0 / std::sqrt(1.0 - std::pow(h.beta2, double(step))));
  const float eps = float(h.eps);
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = b1 * m[i] + c1 * gi;
    const float vi = b2 * v[i] + c2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
  }
}

namespace naive {
template <class T>
void adamw_update(T* p, const T* g, T* m, T* v, int64_t n, const AdamWHyper& h, int64_t step) {
  TESSEL_CHECK(step >= 1, "adamw step counts from 1, got ", step);
  const T lr = T(h.lr), b1 = T(h.beta1), b2 = T(h.beta2), eps = T(h.eps), wd = T(h.weight_decay);
  const T bc1 = T(1) - std::pow(b1, T(step));
  const T bc2 = T(1) - std::pow(b2, T(step));
  for (int64_t i = 0; i < n; ++i) {
    p[i] -= lr * wd * p[i];
    m[i] = b1 * m[i] + (T(1) - b1) * g[i];
    v[i] = b2 * v[i] + (T(1) - b2) * g[i] * g[i];
    const T m_hat = m[i] / bc1;
    const T v_hat = v[i] / bc2;
    p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
  }
}
template void adamw_update<float>(float*, const float*, float*, float*, int64_t, const AdamWHyper&,
                                  int64_t);
template void adamw_update<double>(double*, const double*, double*, double*, int64_t,
                                   const AdamWHyper&, int64_t);
}  // namespace naive

AdamW::AdamW(ParameterList params, const AdamWHyper& base, std::vector<ParamTag> decay_tags,
             comm::Communicator* group)
    : params_(std::move(params)),
      base_(base),
      decay_tags_(std::move(decay_tags)),
      group_(group),
      step_(Shape{1}, DType::i32) {
  std::set<std::string> names;
  for (const Parameter& p : params_) {
    TESSEL_CHECK(p.value.dtype() == DType::f32 && p.grad.dtype() == DType::f32, "parameter ",
                 p.name, " must be f32");
    TESSEL_CHECK(p.value.shape() == p.grad.shape(), "parameter ", p.name, " value ",
                 shape_str(p.value.shape()), " and grad ", shape_str(p.grad.shape()), " differ");
    TESSEL_CHECK(names.insert(p.name).second, "duplicate parameter name ", p.name);
    offsets_.push_back(total_);
    total_ += p.value.numel();
  }
  // In place needs one buffer in list order (the model's flat buffer is; a subset may not be).
  contiguous_ = !params_.empty();
  for (size_t i = 0; i < params_.size(); ++i)
    contiguous_ =
        contiguous_ && params_[i].value.f32() == params_.front().value.f32() + offsets_[i];
  hi_ = total_;
  if (sharded()) {
    const int P = group_->size();
    const int64_t chunk = (total_ + P - 1) / P;
    for (int r = 0; r < P; ++r) {
      const int64_t lo = std::min(total_, r * chunk), hi = std::min(total_, lo + chunk);
      range_counts_.push_back(size_t(hi - lo));
      if (r == group_->rank()) lo_ = lo, hi_ = hi;
    }
  }
  m_ = Tensor(Shape{hi_ - lo_});
  v_ = Tensor(Shape{hi_ - lo_});
}

double AdamW::weight_decay_of(const Parameter& param) const {
  bool decays = std::find(decay_tags_.begin(), decay_tags_.end(), param.tag) != decay_tags_.end();
  return decays ? base_.weight_decay : 0.0;
}

template <class F>
void AdamW::for_each_own_piece(F&& f) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t a = offsets_[i], b = a + params_[i].value.numel();
    const int64_t lo = std::max(a, lo_), hi = std::min(b, hi_);
    if (lo < hi) f(i, lo - a, hi - lo, lo);
  }
}

// m, then v: at most one whole tensor (4 bytes per element) is held beside the ranges.
void AdamW::take_loaded_range() {
  for (auto [own, whole] : {std::pair{&m_, &whole_m_}, std::pair{&v_, &whole_v_}}) {
    if (!whole->defined()) continue;
    Tensor range(Shape{hi_ - lo_});
    std::copy_n(whole->f32() + lo_, hi_ - lo_, range.f32());
    *own = range;
    *whole = Tensor();
  }
}

void AdamW::step(double lr_scale) {
  int32_t& t = step_.i32()[0];
  TESSEL_CHECK(t < std::numeric_limits<int32_t>::max(), "adamw step counter overflow");
  ++t;
  take_loaded_range();
  AdamWHyper h = base_;
  h.lr = base_.lr * lr_scale;
  for_each_own_piece([&](size_t i, int64_t first, int64_t n, int64_t at) {
    Parameter& p = params_[i];
    h.weight_decay = weight_decay_of(p);
    adamw_update(p.value.f32() + first, p.grad.f32() + first, m_.f32() + (at - lo_),
                 v_.f32() + (at - lo_), n, h, t);
  });
  if (!sharded()) return;
  if (contiguous_) {  // the model's flat buffer: gathered in place, no copy
    float* all = params_.front().value.f32();
    group_->all_gatherv(std::span<const float>(all + lo_, size_t(hi_ - lo_)),
                        std::span<float>(all, size_t(total_)), range_counts_);
    return;
  }
  std::vector<float> own(size_t(hi_ - lo_)), all(static_cast<size_t>(total_));
  for_each_own_piece([&](size_t i, int64_t first, int64_t n, int64_t at) {
    std::copy_n(params_[i].value.f32() + first, n, own.data() + (at - lo_));
  });
  group_->all_gatherv(own, all, range_counts_);
  for (size_t i = 0; i < params_.size(); ++i)
    std::copy_n(all.data() + offsets_[i], params_[i].value.numel(), params_[i].value.f32());
}

std::vector<StateTensor> AdamW::state() {
  if (sharded()) {
    // The range becomes a view of the whole tensor, so a checkpoint holds 8 bytes per
    // element (as replicated state does), not that plus the ranges.
    for (auto [own, whole] : {std::pair{&m_, &whole_m_}, std::pair{&v_, &whole_v_}}) {
      if (!whole->defined()) {
        *whole = Tensor(Shape{total_});
        group_->all_gatherv(std::span<const float>(own->f32(), size_t(hi_ - lo_)),
                            std::span<float>(whole->f32(), size_t(total_)), range_counts_);
        *own = whole->view(lo_, Shape{hi_ - lo_});
      }
    }
  }
  const Tensor& m = sharded() ? whole_m_ : m_;
  const Tensor& v = sharded() ? whole_v_ : v_;
  std::vector<StateTensor> out;
  out.push_back({"adamw.step", step_});
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    out.push_back({"adamw.m/" + p.name, m.view(offsets_[i], p.value.shape())});
    out.push_back({"adamw.v/" + p.name, v.view(offsets_[i], p.value.shape())});
  }
  return out;
}

}  // namespace tessel::optim
