"""elastic_ssm.elastic"""
