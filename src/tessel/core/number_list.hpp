#pragma once
// Config values that hold comma-separated numbers ("2,2,4"): one parser for every such key
// (pipeline.layout, optim.ns_restarts, fault.kill_steps, fault.hang_steps, fault.kill_seconds).
// Spaces around an item are ignored and an empty value is an empty list; an empty item, an
// item that is not a number, or a number below `min` is an InputError naming the key and the
// item.
#include <cstdint>
#include <string>
#include <vector>

namespace tessel {

std::vector<int64_t> parse_int_list(const std::string& key, const std::string& text, int64_t min);
std::vector<double> parse_real_list(const std::string& key, const std::string& text, double min);

}  // namespace tessel
