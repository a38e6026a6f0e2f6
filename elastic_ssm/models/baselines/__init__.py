"""elastic_ssm.models.baselines"""
