#include "tessel/optim/optimizer.hpp"

#include <cmath>
#include <sstream>

#include "tessel/core/error.hpp"
#include "tessel/optim/adamw.hpp"

namespace tessel::optim {

namespace {
constexpr ParamTag kAllTags[] = {ParamTag::embedding, ParamTag::position_embedding,
                                 ParamTag::head,      ParamTag::hidden_matrix,
                                 ParamTag::norm,      ParamTag::bias};

void check_range(bool ok, const char* field, double value, const char* expected) {
  if (!ok) input_error(field, " = ", value, " is out of range (expected ", expected, ")");
}
}  // namespace

void validate(const OptimizerConfig& c) {
  check_range(std::isfinite(c.lr) && c.lr > 0, "optim.lr", c.lr, "> 0");
  check_range(c.beta1 >= 0 && c.beta1 < 1, "optim.beta1", c.beta1, "0 <= beta1 < 1");
  check_range(c.beta2 >= 0 && c.beta2 < 1, "optim.beta2", c.beta2, "0 <= beta2 < 1");
  check_range(std::isfinite(c.eps) && c.eps > 0, "optim.eps", c.eps, "> 0");
  check_range(std::isfinite(c.weight_decay) && c.weight_decay >= 0 && c.lr * c.weight_decay < 1,
              "optim.weight_decay", c.weight_decay, ">= 0 and lr * weight_decay < 1");
  parse_decay_tags(c.decay_tags);
}

std::vector<ParamTag> parse_decay_tags(const std::string& text) {
  std::vector<ParamTag> tags;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (item.empty()) continue;
    bool found = false;
    for (ParamTag tag : kAllTags) {
      if (item == param_tag_name(tag)) {
        tags.push_back(tag);
        found = true;
      }
    }
    if (!found) {
      input_error("optim.decay_tags: unknown tag '", item,
                  "' (expected a comma-separated list of embedding, position_embedding, head, "
                  "hidden_matrix, norm, bias)");
    }
  }
  return tags;
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config, ParameterList params) {
  validate(config);
  if (config.name == "adamw") {
    AdamWHyper base{config.lr, config.beta1, config.beta2, config.eps, config.weight_decay};
    return std::make_unique<AdamW>(std::move(params), base, parse_decay_tags(config.decay_tags));
  }
  input_error("optim.name = '", config.name, "' is not a known optimizer (expected adamw)");
}

}  // namespace tessel::optim
