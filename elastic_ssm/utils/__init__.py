"""Small helpers shared across elastic_ssm that belong to no model, op or training concept."""
