#include "tessel/core/parameter.hpp"

namespace tessel {

const char* param_tag_name(ParamTag tag) {
  switch (tag) {
    case ParamTag::embedding:
      return "embedding";
    case ParamTag::position_embedding:
      return "position_embedding";
    case ParamTag::head:
      return "head";
    case ParamTag::hidden_matrix:
      return "hidden_matrix";
    case ParamTag::norm:
      return "norm";
    case ParamTag::bias:
      return "bias";
    case ParamTag::router:
      return "router";
    case ParamTag::balance_bias:
      return "balance_bias";
  }
  return "unknown";
}

}  // namespace tessel
