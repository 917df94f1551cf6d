"""Pure functions from (recipe, model, plan) to the files a launch needs; they read the plan, never re-derive it."""
