"""The bad inputs that the boundary tests of the core and of the methods draw (hypothesis)."""

import math

from hypothesis import strategies as st

#: Values that are not a valid size: wrong kinds and non-positive ints.
BAD_SIZE = st.one_of(
    st.text(max_size=3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.integers(max_value=0),
    st.lists(st.integers(), max_size=2),
)
#: Values that are not a finite real number.
BAD_REAL = st.one_of(
    st.text(max_size=3),
    st.booleans(),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.lists(st.floats(), max_size=2),
)
