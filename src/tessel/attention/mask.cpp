#include "tessel/attention/mask.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::attention {

namespace {

const char* vector_name(int v) {
  static const char* names[] = {"LTS", "LTE", "UTS", "UTE"};
  return names[v];
}

// Position of canonical vector v in the input form, or -1 when the form does not carry it.
int input_index(int V, bool causal, int v) {
  if (V == 4) return v;
  if (v == kLTS) return 0;
  if (V == 2 && causal && v == kLTE) return 1;
  if (V == 2 && !causal && v == kUTE) return 1;
  return -1;
}

}  // namespace

ColumnMask::ColumnMask(int64_t B, int64_t Hm, int64_t Sq, int64_t Sk, int V, bool causal,
                       const std::vector<int32_t>& values)
    : B_(B), Hm_(Hm), Sq_(Sq), Sk_(Sk), causal_(causal) {
  if (B < 1 || Hm < 1 || Sq < 1 || Sk < 1)
    input_error("attention mask: batch, mask heads, Sq and Sk must be >= 1, got B=", B, " Hm=", Hm,
                " Sq=", Sq, " Sk=", Sk);
  if (causal && V != 1 && V != 2)
    input_error("attention mask: a causal mask has V = 1 [LTS] or 2 [LTS, LTE], got V = ", V);
  if (!causal && V != 2 && V != 4)
    input_error(
        "attention mask: a non-causal mask has V = 2 [LTS, UTE] or 4 [LTS, LTE, UTS, "
        "UTE], got V = ",
        V);
  if (int64_t(values.size()) != B * Hm * Sk * V)
    input_error("attention mask: expected int32 [B=", B, ", Hm=", Hm, ", Sk=", Sk, ", V=", V,
                "] = ", B * Hm * Sk * V, " values, got ", values.size());
  if (Sq > INT32_MAX) input_error("attention mask: Sq = ", Sq, " exceeds int32");
  // Absent vectors take their "empty interval" defaults (spec §2, derived canonical form).
  const int32_t defaults[4] = {int32_t(Sq), int32_t(Sq), 0, 0};
  data_.resize(size_t(B * Hm * 4 * Sk));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hm = 0; hm < Hm; ++hm)
      for (int v = 0; v < 4; ++v) {
        int32_t* out = data_.data() + ((b * Hm + hm) * 4 + v) * Sk;
        const int idx = input_index(V, causal, v);
        for (int64_t j = 0; j < Sk; ++j) {
          const int32_t x =
              idx < 0 ? defaults[v] : values[size_t(((b * Hm + hm) * Sk + j) * V + idx)];
          if (x < 0 || x > Sq)
            input_error("attention mask: ", vector_name(v), "[b=", b, ", head=", hm, ", col=", j,
                        "] = ", x, " is outside [0, Sq=", Sq, "]");
          out[j] = x;
        }
      }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hm = 0; hm < Hm; ++hm)
      for (int start = kLTS; start <= kUTS; start += 2) {
        const int32_t* s = vector(b, hm, start);
        const int32_t* e = vector(b, hm, start + 1);
        for (int64_t j = 0; j < Sk; ++j)
          if (s[j] > e[j])
            input_error("attention mask: ", vector_name(start), " > ", vector_name(start + 1),
                        " at [b=", b, ", head=", hm, ", col=", j, "] (", s[j], " > ", e[j],
                        "): an interval's start must not exceed its end");
      }
}

ColumnMask ColumnMask::causal_only(int64_t B, int64_t Sq, int64_t Sk) {
  return ColumnMask(B, 1, Sq, Sk, 1, true, std::vector<int32_t>(size_t(B * Sk), int32_t(Sq)));
}

int64_t broadcast_head(const char* what, int64_t Hm, int64_t h, int64_t Hq, int64_t Hk) {
  if (Hm == 1) return 0;
  if (Hm == Hq) return h;
  if (Hm == Hk) return h / (Hq / Hk);
  check_broadcast_heads(what, Hm, Hq, Hk);
  return 0;
}

void check_broadcast_heads(const char* what, int64_t Hm, int64_t Hq, int64_t Hk) {
  if (Hm != 1 && Hm != Hq && Hm != Hk)
    input_error(what, ": mask heads Hm = ", Hm, " must be 1, Hq = ", Hq, " or Hk = ", Hk);
}

int64_t ColumnMask::head_for(int64_t h, int64_t Hq, int64_t Hk) const {
  return broadcast_head("attention mask", Hm_, h, Hq, Hk);
}

void ColumnMask::check_heads(int64_t Hq, int64_t Hk) const {
  check_broadcast_heads("attention mask", Hm_, Hq, Hk);
}

bool ColumnMask::visible(int64_t b, int64_t hm, int64_t i, int64_t j) const {
  if (causal_ && j > i + (Sk_ - Sq_)) return false;
  const auto in = [&](int s, int e) { return i >= vector(b, hm, s)[j] && i < vector(b, hm, e)[j]; };
  return !in(kLTS, kLTE) && !in(kUTS, kUTE);
}

namespace naive {

std::vector<uint8_t> dense_mask(const ColumnMask& m) {
  const int64_t B = m.batch(), Hm = m.mask_heads(), Sq = m.rows(), Sk = m.cols();
  std::vector<uint8_t> dense(size_t(B * Hm * Sq * Sk));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hm = 0; hm < Hm; ++hm)
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t j = 0; j < Sk; ++j)
          dense[size_t(((b * Hm + hm) * Sq + i) * Sk + j)] = m.visible(b, hm, i, j) ? 1 : 0;
  return dense;
}

}  // namespace naive

}  // namespace tessel::attention
