#pragma once
// A trainable parameter as the optimizer, the data-parallel reducer and the
// checkpoint see it: a stable name, a shape, a tag that routes it to an
// optimizer, and views of its value and gradient. The model owns the memory
// (one flat buffer for values, one for gradients, in registry order).
#include <string>
#include <vector>

#include "tessel/core/tensor.hpp"

namespace tessel {

// Routing is by explicit tag, never by dimension count.
enum class ParamTag {
  embedding,           // token embedding table [V, C]
  position_embedding,  // learned positions [T, C]
  head,                // output projection [V, C] (absent when tied to the embedding)
  hidden_matrix,       // 2-D weights inside blocks (attention, MLP)
  norm,                // norm gains and biases
  bias,                // linear-layer biases
  router,              // MoE router weights [E, C] (never decayed)
  balance_bias,        // MoE selection bias beta [E]: set by the balancing update, never by a
                       // gradient (its gradient stays 0, so AdamW leaves it unchanged)
};
const char* param_tag_name(ParamTag tag);

struct Parameter {
  std::string name;
  ParamTag tag;
  Tensor value;  // f32, a view into the model's flat parameter buffer
  Tensor grad;   // f32, same shape, a view into the flat gradient buffer
};

using ParameterList = std::vector<Parameter>;

}  // namespace tessel
