"""elastic_ssm.data"""
