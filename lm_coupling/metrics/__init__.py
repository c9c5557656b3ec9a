"""Pure tensor math of the geometry metrics (torch only).

Modules: ``trajectory`` (norm profile, LSS, expodistance, equidistance),
``lens`` (logit-lens entropy, target probability, fixation depth), ``coupling``
(block coupling matrices and scores) and ``tokenwise`` (token-wise coupling).
"""
