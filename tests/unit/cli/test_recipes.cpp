// Every recipe in configs/ loads: its keys exist, its values pass validation, and the SFT
// recipe fine-tunes the README demo's model (train.init_from's check compares these keys).
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "tessel/train/config.hpp"

namespace fs = std::filesystem;

namespace {

// configs/ of the source tree (TESSEL_LAUNCHER is <source>/scripts/launch.sh).
fs::path configs_dir() {
  return fs::path(TESSEL_LAUNCHER).parent_path().parent_path() / "configs";
}

}  // namespace

TEST(Recipes, EveryConfigLoads) {
  std::set<std::string> loaded;
  for (const auto& entry : fs::directory_iterator(configs_dir())) {
    if (entry.path().extension() != ".toml") continue;
    SCOPED_TRACE(entry.path().string());
    EXPECT_NO_THROW(tessel::train::load_config(entry.path().string(), {}));
    loaded.insert(entry.path().filename().string());
  }
  EXPECT_TRUE(loaded.count("default.toml") && loaded.count("sft.toml")) << loaded.size();
}

TEST(Recipes, SftFineTunesTheDemoModel) {
  const auto demo = tessel::train::load_config((configs_dir() / "default.toml").string(), {});
  const auto sft = tessel::train::load_config((configs_dir() / "sft.toml").string(), {});
  EXPECT_EQ(sft.train.init_from, demo.run.dir);
  for (const auto& key : tessel::train::config_schema())
    if (key.name.rfind("model.", 0) == 0) {
      EXPECT_EQ(key.get(sft), key.get(demo)) << key.name;
    }
}
