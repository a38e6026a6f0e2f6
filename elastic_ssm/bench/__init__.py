"""elastic_ssm.bench"""
