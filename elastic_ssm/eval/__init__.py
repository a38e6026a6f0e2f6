"""elastic_ssm.eval"""
