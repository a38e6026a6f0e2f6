"""elastic_ssm.hf"""
