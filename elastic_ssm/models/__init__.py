"""elastic_ssm.models"""
