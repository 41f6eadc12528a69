"""The paired quality check (``check``): a baseline arm and a plan arm trained on identical
terms, scored on the same held-out examples, their relative NE and AUC changes given with
intervals over examples and seeds (``stats``); the NE budget (``budget``): a plan's
costliest FP8 site-roles moved back to the baseline until the paired check holds; the
serving NE budget (``serving``): the same for a serving plan on a trained model, whose
examples are its only noise."""

from .budget import (DEFAULT_MAX_NE_CHANGE, BaselineNotLearnedError, NEBudgetResult,
                     PairedArms, SiteRoleCost,
                     fp8_site_roles, ne_budget, only, second_order_cost, site_role_costs,
                     without)
from .serving import ServeBudgetResult, fp8_forwards, serve_ne_budget
from .check import (SCHEMA, SCHEMA_VERSION, QualityResult, SeedResult, deterministic,
                    paired_check, predict)
from .stats import (bootstrap_ratio_interval, example_log_losses, paired_auc, ratio_interval,
                    t_interval, t_quantile, z_quantile)

__all__ = ["paired_check", "QualityResult", "SeedResult", "predict", "deterministic",
           "SCHEMA", "SCHEMA_VERSION", "example_log_losses", "ratio_interval",
           "bootstrap_ratio_interval", "paired_auc", "t_interval", "t_quantile", "z_quantile",
           "ne_budget", "NEBudgetResult", "PairedArms", "SiteRoleCost", "site_role_costs",
           "second_order_cost", "fp8_site_roles", "only", "without", "DEFAULT_MAX_NE_CHANGE",
           "BaselineNotLearnedError", "serve_ne_budget", "ServeBudgetResult",
           "fp8_forwards"]
