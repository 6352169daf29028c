"""The vectorised chunk waste equals the sequential packing of ColossalAI's search."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.backends.colossalai.gemini import unused_elements, unused_elements_many


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.lists(st.integers(5000, 20000), min_size=1, max_size=10))
def test_vectorised_waste_matches_sequential(sizes, chunk_sizes):
    many = unused_elements_many(sizes, np.array(chunk_sizes))
    assert many.tolist() == [unused_elements(sizes, c) for c in chunk_sizes]
