#pragma once
// Config values that hold comma-separated lists ("2,2,4"; "data/a, data/b"): one splitter for
// every such key (data.path, data.weights, pipeline.layout, model.moe_layers, optim.ns_restarts,
// optim.decay_tags, fault.kill_steps, fault.hang_steps, fault.kill_seconds) and the parsers of
// numbers on it. Spaces around an item are ignored and an empty value is an empty list. Each
// number is read as a config file reads one (TOML, toml_value.hpp: 1_000, 0x10, 5e-324), so an
// empty item, an item that is no such number (C's .5, 1., 007 or 0x1p3, inf, nan, a float
// outside a double's range, a '#'), a float in an integer list, a number below `min` (or equal
// to it, where `min_excluded`), or a signed one where `min` >= 0 ("-0") is an InputError
// naming the key and the item.
#include <cstdint>
#include <string>
#include <vector>

namespace tessel {

std::vector<std::string> split_list(const std::string& key, const std::string& text);

std::vector<int64_t> parse_int_list(const std::string& key, const std::string& text, int64_t min);
std::vector<double> parse_real_list(const std::string& key, const std::string& text, double min,
                                    bool min_excluded = false);

}  // namespace tessel
