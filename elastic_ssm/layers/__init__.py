"""elastic_ssm.layers"""
