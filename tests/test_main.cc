// The one translation unit that defines Boost.Test's main() for every test binary.
#define BOOST_TEST_MODULE flashd
#include <boost/test/unit_test.hpp>
