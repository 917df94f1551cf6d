"""`dmt explore`: the estimator and planner behind a local web page (a JSON API and static assets)."""
