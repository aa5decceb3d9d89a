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

AdamW::AdamW(ParameterList params, const AdamWHyper& base, std::vector<ParamTag> decay_tags)
    : params_(std::move(params)),
      base_(base),
      decay_tags_(std::move(decay_tags)),
      step_(Shape{1}, DType::i32) {
  std::set<std::string> names;
  int64_t total = 0;
  for (const Parameter& p : params_) {
    TESSEL_CHECK(p.value.dtype() == DType::f32 && p.grad.dtype() == DType::f32, "parameter ",
                 p.name, " must be f32");
    TESSEL_CHECK(p.value.shape() == p.grad.shape(), "parameter ", p.name, " value ",
                 shape_str(p.value.shape()), " and grad ", shape_str(p.grad.shape()), " differ");
    TESSEL_CHECK(names.insert(p.name).second, "duplicate parameter name ", p.name);
    offsets_.push_back(total);
    total += p.value.numel();
  }
  m_ = Tensor(Shape{total});
  v_ = Tensor(Shape{total});
}

double AdamW::weight_decay_of(const Parameter& param) const {
  bool decays = std::find(decay_tags_.begin(), decay_tags_.end(), param.tag) != decay_tags_.end();
  return decays ? base_.weight_decay : 0.0;
}

void AdamW::step(double lr_scale) {
  int32_t& t = step_.i32()[0];
  TESSEL_CHECK(t < std::numeric_limits<int32_t>::max(), "adamw step counter overflow");
  ++t;
  AdamWHyper h = base_;
  h.lr = base_.lr * lr_scale;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = params_[i];
    h.weight_decay = weight_decay_of(p);
    int64_t n = p.value.numel();
    adamw_update(p.value.f32(), p.grad.f32(), m_.f32() + offsets_[i], v_.f32() + offsets_[i], n, h,
                 t);
  }
}

std::vector<StateTensor> AdamW::state() {
  std::vector<StateTensor> out;
  out.push_back({"adamw.step", step_});
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    out.push_back({"adamw.m/" + p.name, m_.view(offsets_[i], p.value.shape())});
    out.push_back({"adamw.v/" + p.name, v_.view(offsets_[i], p.value.shape())});
  }
  return out;
}

}  // namespace tessel::optim
