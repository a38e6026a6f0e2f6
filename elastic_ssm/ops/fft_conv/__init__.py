"""elastic_ssm.ops.fft_conv"""
