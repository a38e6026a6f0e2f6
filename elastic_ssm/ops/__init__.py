"""elastic_ssm.ops"""
