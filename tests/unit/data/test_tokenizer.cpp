#include <gtest/gtest.h>

#include "tessel/core/error.hpp"
#include "tessel/data/byte_tokenizer.hpp"

using namespace tessel;
using namespace tessel::data;

TEST(ByteTokenizer, EveryByteRoundTrips) {
  std::string text;
  for (int c = 0; c < 256; ++c) text.push_back(char(c));
  text += "In the beginning — «Anfang» 始め\n";
  const ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 256);
  const auto ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  for (int c = 0; c < 256; ++c) EXPECT_EQ(ids[size_t(c)], c);  // id = unsigned byte value
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode({}), "");
}

TEST(ByteTokenizer, DecodeRejectsIdsOutsideVocab) {
  const ByteTokenizer tok;
  for (int32_t bad : {-1, 256, 100000}) {
    const std::vector<int32_t> ids = {65, bad};
    try {
      tok.decode(ids);
      ADD_FAILURE() << "no error for id " << bad;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
    }
  }
}
