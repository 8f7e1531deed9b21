"""Test tools that users may reuse (as chex ships its fakes).

Modules here may import the library; the library never imports them.

  adversarial   the adversarial weight, logit and (p, q) rows that the
                oracle, identity and qualification checks run on
"""
