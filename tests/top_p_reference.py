"""Top-p from its definition, in float64: the reference the top-p tests hold the floors to.

Top-p keeps a token when the tokens strictly more likely than it hold less than top_p of the probability (ties
decide together). The GPU sums probabilities in float32, a row of 151,936 of them in a fixed order, so a value
whose float64 mass above it is within float32 rounding of top_p may be decided either way: BORDERLINE is that
margin, as a share of the row's total (observed errors are near 1e-7; a floor one distinct value off moves the
mass by a token's probability, far more except for tokens that are themselves that unlikely)."""
import numpy as np

BORDERLINE = 1e-5


def mass_above(row: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The row's distinct finite values (ascending) and, for each, the share of softmax(row / T) strictly above it."""
    x = np.asarray(row, dtype=np.float64)
    finite = np.isfinite(x)
    weights = np.exp((x[finite] - x[finite].max()) / temperature)
    values, group = np.unique(x[finite], return_inverse=True)
    per_value = np.bincount(group, weights=weights)
    above = np.concatenate([np.cumsum(per_value[::-1])[::-1][1:], [0.0]])
    return values, above / weights.sum()


def definition_floor(row: np.ndarray, temperature: float, top_p: float) -> float:
    values, above = mass_above(row, temperature)
    return float(values[above < top_p].min())


def misjudged(row: np.ndarray, temperature: float, top_p: float, floor: float) -> np.ndarray:
    """The distinct values a floor keeps or drops against the definition, borderline ones aside (empty: right)."""
    values, above = mass_above(row, temperature)
    wrong = (above < top_p) != (values >= floor)
    return values[wrong & (np.abs(above - top_p) > BORDERLINE)]
