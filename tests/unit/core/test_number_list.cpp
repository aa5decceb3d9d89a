#include <gtest/gtest.h>

#include "support/expect_input_error.hpp"
#include "tessel/core/number_list.hpp"

using namespace tessel;

TEST(NumberList, ParsesTrimmedItemsAndAnEmptyValue) {
  EXPECT_EQ(parse_int_list("k", "2, 3 ,0", 0), (std::vector<int64_t>{2, 3, 0}));
  EXPECT_EQ(parse_int_list("k", "7", 1), (std::vector<int64_t>{7}));
  EXPECT_TRUE(parse_int_list("k", "", 0).empty());
  EXPECT_TRUE(parse_int_list("k", "  ", 0).empty());
  EXPECT_EQ(parse_real_list("k", "0.5,2e-3, 4", 0), (std::vector<double>{0.5, 2e-3, 4}));
}

TEST(NumberList, RejectsEmptyItemsNonNumbersAndValuesBelowTheMinimum) {
  using fixture::expect_input_error;
  expect_input_error([] { parse_int_list("pipeline.layout", "2,x", 0); },
                     {"'pipeline.layout'", "\"2,x\"", "'x'", "integer >= 0"});
  expect_input_error([] { parse_int_list("k", "1,,2", 0); }, {"''"});
  expect_input_error([] { parse_int_list("k", "1,", 0); }, {"''"});
  expect_input_error([] { parse_int_list("k", "3x", 0); }, {"'3x'"});
  expect_input_error([] { parse_int_list("k", "1.5", 0); }, {"'1.5'"});
  // No sign where no value is negative: "-0" and "+3" were taken for 0 and 3.
  expect_input_error([] { parse_int_list("pipeline.layout", "4,-0", 0); },
                     {"'-0' is not an integer >= 0"});
  expect_input_error([] { parse_int_list("k", "+3", 1); }, {"'+3' is not an integer >= 1"});
  expect_input_error([] { parse_int_list("k", "\t-0", 0); }, {"is not an integer >= 0"});
  expect_input_error([] { parse_real_list("k", "0.5,-0", 0); }, {"'-0' is not a number >= 0"});
  expect_input_error([] { parse_int_list("optim.ns_restarts", "0", 1); }, {"'0'", ">= 1"});
  expect_input_error([] { parse_int_list("k", "99999999999999999999", 0); }, {"'9999"});
  expect_input_error([] { parse_real_list("k", "-0.5", 0); }, {"'-0.5'", "number >= 0"});
  expect_input_error([] { parse_real_list("k", "nan", 0); }, {"'nan'"});
  expect_input_error([] { parse_real_list("k", "inf", 0); }, {"'inf'"});
}

// A list's numbers are spelled as a config file's are (TOML, as `--set` reads them): digit
// separators, hex, octal and binary integers and subnormal floats are values; C's other
// spellings, inf, nan and floats outside a double's range are not.
TEST(NumberList, ItemsAreNumbersAsTomlWritesThem) {
  using fixture::expect_input_error;
  EXPECT_EQ(parse_real_list("k", "5e-324, 1", 0, true), (std::vector<double>{5e-324, 1}));
  EXPECT_EQ(parse_real_list("k", "0x10,1_0,1e3,2.5e-1", 0),
            (std::vector<double>{16, 10, 1e3, 0.25}));
  EXPECT_EQ(parse_int_list("k", "0x10,1_000,0o17,0b11", 0),
            (std::vector<int64_t>{16, 1000, 15, 3}));
  for (const char* item : {"0x1p3", ".5", "1.", "007", "1e-400", "1e400", "inf", "+inf", "nan",
                           "1#0", "1 2", "1_", "1e", "0x10.8"})
    expect_input_error([&] { parse_real_list("data.weights", std::string(item) + ",1", 0, true); },
                       {"'data.weights'", std::string("'") + item + "' is not a number > 0",
                        "numbers as TOML writes them"});
  for (const char* item : {"1e3", "1.0", "007", "0x1p3", "1_"})
    expect_input_error(
        [&] { parse_int_list("fault.kill_steps", item, 0); },
        {std::string("'") + item + "' is not an integer >= 0", "integers as TOML writes them"});
}
