"""Fits the return model of the predictive eviction policies (host/predictive_policies.py) from
the releases a Recorder saw: logistic regression for P(a release's conversation is read again),
least squares for log(ticks until it is | it is). numpy only; the policies evaluate the weights in
plain Python.

A release too close to the end of the fitting slice may come back after the slice ends, so the
last `censor_share` of the slice's ticks is left out of both fits (its outcome is not known).
"""
import math

import numpy as np

from pagedjax.host import predictive_policies as pp


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iterations: int = 50
                 ) -> np.ndarray:
  """Newton's method on the mean log loss + l2/2 |w|^2 (bias included)."""
  w = np.zeros(x.shape[1])
  for _ in range(iterations):
    p = 1.0 / (1.0 + np.exp(-(x @ w)))
    grad = x.T @ (p - y) / len(y) + l2 * w
    hess = (x * (p * (1 - p))[:, None]).T @ x / len(y) + l2 * np.eye(len(w))
    step = np.linalg.solve(hess, grad)
    w -= step
    if np.max(np.abs(step)) < 1e-8:
      break
  return w


def fit_least_squares(x: np.ndarray, y: np.ndarray, l2: float = 1e-3) -> np.ndarray:
  return np.linalg.solve(x.T @ x / len(y) + l2 * np.eye(x.shape[1]), x.T @ y / len(y))


def auc(score: np.ndarray, y: np.ndarray) -> float:
  """Area under the ROC curve (ties count half)."""
  order = np.argsort(score, kind='stable')
  ranks = np.empty(len(score))
  s = score[order]
  i = 0
  while i < len(s):  # average ranks of ties
    j = i
    while j + 1 < len(s) and s[j + 1] == s[i]:
      j += 1
    ranks[order[i:j + 1]] = (i + j) / 2 + 1
    i = j + 1
  pos = y.sum()
  neg = len(y) - pos
  return float((ranks[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg)) if pos and neg else math.nan


def observed(releases: list, censor_share: float = 0.15):
  """(x, returned, delay ticks) of the releases whose outcome the slice shows."""
  if not releases:
    raise ValueError('no releases recorded: the fitting slice is empty')
  last = max(r['major'] for r in releases)
  first = min(r['major'] for r in releases)
  cut = last - censor_share * (last - first)
  kept = [r for r in releases if r['major'] <= cut]
  x = np.array([r['x'] for r in kept], float)
  returned = np.array([r['read_at'] is not None for r in kept], float)
  delay = np.array([r['read_at'] - r['major'] if r['read_at'] is not None else np.nan
                    for r in kept], float)
  return x, returned, delay


def fit(releases: list, censor_share: float = 0.15) -> dict:
  """Weights (predictive_policies.FEATURES order) and the fit's own figures."""
  x, returned, delay = observed(releases, censor_share)
  if returned.min() == returned.max():
    raise ValueError('every observed release came back, or none did: nothing to fit')
  weights = fit_logistic(x, returned)
  back = returned == 1
  delay_weights = fit_least_squares(x[back], np.log(np.maximum(delay[back], 1.0)))
  p = 1.0 / (1.0 + np.exp(-(x @ weights)))
  return {'weights': [float(v) for v in weights],
          'delay_weights': [float(v) for v in delay_weights],
          'features': list(pp.FEATURES), 'releases': int(len(returned)),
          'return_share': float(returned.mean()), 'auc': auc(p, returned),
          'median_delay_ticks': float(np.median(delay[back]))}


def evaluate(releases: list, weights, censor_share: float = 0.15) -> dict:
  """AUC and calibration of fitted weights on other releases (the held-out half)."""
  x, returned, _ = observed(releases, censor_share)
  p = 1.0 / (1.0 + np.exp(-(x @ np.asarray(weights))))
  return {'releases': int(len(returned)), 'return_share': float(returned.mean()),
          'mean_predicted': float(p.mean()), 'auc': auc(p, returned)}
